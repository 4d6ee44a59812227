//! The disk tier's files: written and read on threads of their own, never on the step path.
//!
//! Owns the directory: one file per snapshot ([`cache::snapshot_file`]), named by its prefix
//! hash, written under a temporary name, synced and renamed into place (a crash leaves either
//! no file or a whole one), and a manifest listing them, rewritten the same way after every
//! change. Opening the directory indexes it: every file's header and tables are checked and
//! its length compared with the header's, and files of another model, geometry or format, cut
//! short, or left half-written by a crash are deleted, each with a log line.
//!
//! A write takes its bytes from host memory the caller keeps alive until the write is
//! reported (a host-tier buffer: [`crate::backend::HostRun`]) or from an owned copy, and sums
//! every block as it writes it: a block that no longer matches the sum its buffer was filled
//! with is not written (the copy in memory went bad; the file would carry it). A read fills
//! host memory the caller keeps alive, summing every block against the file's table: a file
//! whose payload went bad on disk is refused. Both split their bytes into pieces read or
//! written by several threads at once, so a snapshot of gigabytes moves at the disk's speed.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;

use cache::checksum::block_sum;
use cache::snapshot_file::{FileHeader, FileTables, HEADER_LEN, block_bytes};
use cache::{BackingId, PrefixHash, SnapshotGeometry, SnapshotId};

use crate::backend::HostRun;

/// Bytes one thread reads or writes at a time.
const PIECE_BYTES: usize = 64 << 20;
/// Jobs (whole snapshots) in flight at once.
const JOB_THREADS: usize = 2;
const SUFFIX: &str = "snap";
/// A deleted file, renamed while it is unlinked.
const DOOMED: &str = "deleting";
const MANIFEST: &str = "manifest.json";

/// Why a disk copy did not happen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DiskFault {
    /// The file system failed.
    Io(String),
    /// The bytes did not match their sums: in memory (a write) or on disk (a read).
    Corrupt(String),
}

impl std::fmt::Display for DiskFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DiskFault::Io(e) => write!(f, "disk: {e}"),
            DiskFault::Corrupt(e) => write!(f, "corrupt: {e}"),
        }
    }
}

/// A snapshot file found when the directory was opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    pub path: PathBuf,
    pub chain: Vec<PrefixHash>,
    pub kept: bool,
    pub last_used_ms: u64,
    pub bytes: u64,
}

/// Where a write's bytes are.
pub enum DiskSource {
    /// Host memory the caller keeps, unchanged, until the write is reported.
    Runs(Vec<HostRun>),
    Owned(Vec<u8>),
}

/// A snapshot to write.
pub struct WriteJob {
    /// The file's backing id.
    pub to: BackingId,
    pub snapshot: SnapshotId,
    pub chain: Arc<[PrefixHash]>,
    /// The block sums its buffer was filled with.
    pub sums: Vec<u64>,
    pub kept: bool,
    pub source: DiskSource,
}

/// A finished disk copy.
#[derive(Debug)]
pub enum DiskDone {
    /// The file `to` is written (or not).
    Written {
        to: BackingId,
        result: Result<(), DiskFault>,
    },
    /// The memory buffer `to` holds the file `from` (or not); on success, its page hashes and
    /// block sums.
    Read {
        from: BackingId,
        to: BackingId,
        result: Result<FileTables, DiskFault>,
    },
}

enum Job {
    Write {
        job: WriteJob,
        path: PathBuf,
    },
    Read {
        from: BackingId,
        to: BackingId,
        path: PathBuf,
        into: Vec<HostRun>,
    },
}

/// The disk tier of one backend.
pub struct DiskTier {
    dir: PathBuf,
    model: u128,
    geometry: SnapshotGeometry,
    /// Files written, by backing.
    files: HashMap<BackingId, Entry>,
    /// Files being written, by backing.
    writing: HashMap<BackingId, Entry>,
    jobs: Option<mpsc::Sender<Job>>,
    done: mpsc::Receiver<DiskDone>,
    in_flight: usize,
    threads: Vec<JoinHandle<()>>,
}

#[derive(Debug, Clone)]
struct Entry {
    path: PathBuf,
    tokens: usize,
    bytes: u64,
    kept: bool,
    last_used_ms: u64,
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl DiskTier {
    /// Opens (creating) `dir` for snapshots of `model` with `geometry`, and indexes what it
    /// holds: the files that check out, oldest use first. Every other file of ours is deleted
    /// with a log line saying why.
    pub fn open(
        dir: &Path,
        model: u128,
        geometry: SnapshotGeometry,
    ) -> std::io::Result<(DiskTier, Vec<Found>)> {
        std::fs::create_dir_all(dir)?;
        let mut found = Vec::new();
        for entry in std::fs::read_dir(dir)? {
            let path = entry?.path();
            let Some(ext) = path.extension().and_then(|e| e.to_str()) else {
                continue;
            };
            match ext {
                "tmp" => {
                    tracing::warn!(
                        "snapshot disk tier: removing {}, a write a crash interrupted",
                        path.display()
                    );
                    let _ = std::fs::remove_file(&path);
                }
                DOOMED => {
                    let _ = std::fs::remove_file(&path);
                }
                SUFFIX => match index_file(&path, model, &geometry) {
                    Ok(file) => found.push(file),
                    Err(reason) => {
                        tracing::warn!("snapshot disk tier: dropping {}: {reason}", path.display());
                        let _ = std::fs::remove_file(&path);
                    }
                },
                _ => {}
            }
        }
        found.sort_by_key(|f| f.last_used_ms);
        let (jobs, receive) = mpsc::channel::<Job>();
        let (send_done, done) = mpsc::channel();
        let receive = Arc::new(std::sync::Mutex::new(receive));
        let threads = (0..JOB_THREADS)
            .map(|i| {
                let (receive, send_done) = (receive.clone(), send_done.clone());
                let block = block_bytes(&geometry.kv);
                std::thread::Builder::new()
                    .name(format!("snapserve-disk-{i}"))
                    .spawn(move || {
                        loop {
                            let job = receive
                                .lock()
                                .map_err(drop)
                                .and_then(|r| r.recv().map_err(drop));
                            let Ok(job) = job else { return };
                            let _ = send_done.send(run(job, model, geometry, block));
                        }
                    })
            })
            .collect::<std::io::Result<Vec<_>>>()?;
        let tier = DiskTier {
            dir: dir.to_path_buf(),
            model,
            geometry,
            files: HashMap::new(),
            writing: HashMap::new(),
            jobs: Some(jobs),
            done,
            in_flight: 0,
            threads,
        };
        tracing::info!(
            "snapshot disk tier at {}: {} snapshots ({:.2} GiB) found",
            dir.display(),
            found.len(),
            found.iter().map(|f| f.bytes).sum::<u64>() as f64 / (1u64 << 30) as f64
        );
        Ok((tier, found))
    }

    /// Names the file a store adopted from [`DiskTier::open`]'s list.
    pub fn bind(&mut self, backing: BackingId, found: &Found) {
        let entry = Entry {
            path: found.path.clone(),
            tokens: found.chain.len() * self.geometry.kv.page_tokens,
            bytes: found.bytes,
            kept: found.kept,
            last_used_ms: found.last_used_ms,
        };
        self.files.insert(backing, entry);
    }

    fn path_for(&self, chain: &[PrefixHash]) -> PathBuf {
        let end = chain.last().map_or(0, |h| h.0);
        self.dir.join(format!("{end:032x}.{SUFFIX}"))
    }

    /// Starts writing a snapshot's file; reported by [`DiskTier::finished`].
    pub fn write(&mut self, job: WriteJob) {
        let path = self.path_for(&job.chain);
        let entry = Entry {
            path: path.clone(),
            tokens: job.chain.len() * self.geometry.kv.page_tokens,
            bytes: self.geometry.bytes_for_pages(job.chain.len()),
            kept: job.kept,
            last_used_ms: now_ms(),
        };
        self.writing.insert(job.to, entry);
        self.send(Job::Write { job, path });
    }

    /// Starts reading file `from` into `into` (the memory buffer `to`, which the caller keeps
    /// until the read is reported).
    pub fn read(&mut self, from: BackingId, to: BackingId, into: Vec<HostRun>) {
        // A file this tier does not hold fails in the worker, reported with the others.
        let path = self.files.get(&from).map_or_else(
            || self.dir.join(format!("missing-{}", from.0)),
            |e| e.path.clone(),
        );
        self.send(Job::Read {
            from,
            to,
            path,
            into,
        });
    }

    fn send(&mut self, job: Job) {
        self.in_flight += 1;
        if let Some(jobs) = &self.jobs {
            let _ = jobs.send(job);
        }
    }

    /// Deletes a file (evicted, promoted, or refused). Unlinking a file of gigabytes frees its
    /// cached pages and takes a second: the file is renamed out of the way at once (so a new
    /// file of the same prefix never meets it) and unlinked on a thread of its own.
    pub fn delete(&mut self, backing: BackingId) {
        if let Some(entry) = self.files.remove(&backing) {
            let doomed = entry.path.with_extension(DOOMED);
            match std::fs::rename(&entry.path, &doomed) {
                Ok(()) => {
                    let unlink = move || {
                        if let Err(e) = std::fs::remove_file(&doomed) {
                            tracing::warn!("deleting {}: {e}", doomed.display());
                        }
                    };
                    if std::thread::Builder::new()
                        .name("snapserve-unlink".into())
                        .spawn(unlink)
                        .is_err()
                    {
                        let _ = std::fs::remove_file(entry.path.with_extension(DOOMED));
                    }
                }
                Err(e) => tracing::warn!("deleting {}: {e}", entry.path.display()),
            }
            self.write_manifest();
        }
    }

    /// The copies that ended since the last call; with `wait`, every one in flight.
    pub fn finished(&mut self, wait: bool) -> Vec<DiskDone> {
        let mut ended = Vec::new();
        while self.in_flight > 0 {
            let next = if wait {
                self.done.recv().ok()
            } else {
                self.done.try_recv().ok()
            };
            let Some(done) = next else { break };
            self.in_flight -= 1;
            if let DiskDone::Written { to, result } = &done
                && let Some(entry) = self.writing.remove(to)
                && result.is_ok()
            {
                self.files.insert(*to, entry);
                self.write_manifest();
            }
            ended.push(done);
        }
        ended
    }

    /// Copies running or not yet reported.
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// Bytes of the files written.
    pub fn bytes(&self) -> u64 {
        self.files.values().map(|e| e.bytes).sum()
    }

    pub fn holds(&self, backing: BackingId) -> bool {
        self.files.contains_key(&backing) || self.writing.contains_key(&backing)
    }

    pub fn ids(&self) -> Vec<BackingId> {
        self.files
            .keys()
            .chain(self.writing.keys())
            .copied()
            .collect()
    }

    /// Rewrites the manifest (temporary name, then renamed): what the directory holds, for
    /// operators and tools; the files themselves are the truth when it is indexed.
    fn write_manifest(&self) {
        let snapshots: Vec<serde_json::Value> = self
            .files
            .values()
            .map(|e| {
                serde_json::json!({
                    "file": e.path.file_name().map(|n| n.to_string_lossy().into_owned()),
                    "tokens": e.tokens,
                    "bytes": e.bytes,
                    "kept": e.kept,
                    "last_used_ms": e.last_used_ms,
                })
            })
            .collect();
        let manifest = serde_json::json!({
            "format": "snapserve snapshot files v1",
            "model": format!("{:032x}", self.model),
            "snapshots": snapshots,
        });
        let tmp = self.dir.join(format!("{MANIFEST}.tmp"));
        let written = std::fs::write(&tmp, manifest.to_string())
            .and_then(|()| std::fs::rename(&tmp, self.dir.join(MANIFEST)));
        if let Err(e) = written {
            tracing::warn!(
                "writing the snapshot manifest in {}: {e}",
                self.dir.display()
            );
        }
    }
}

impl Drop for DiskTier {
    fn drop(&mut self) {
        self.jobs = None;
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// Checks one file's header, tables and length.
fn index_file(path: &Path, model: u128, geometry: &SnapshotGeometry) -> Result<Found, String> {
    let file = File::open(path).map_err(|e| e.to_string())?;
    let len = file.metadata().map_err(|e| e.to_string())?.len();
    let (header, tables) = read_header(&file, model, geometry)?;
    header.check_file_len(len).map_err(|e| e.to_string())?;
    Ok(Found {
        path: path.to_path_buf(),
        chain: tables.chain,
        kept: header.kept,
        last_used_ms: header.last_used_ms,
        bytes: header.payload_bytes,
    })
}

fn read_header(
    file: &File,
    model: u128,
    geometry: &SnapshotGeometry,
) -> Result<(FileHeader, FileTables), String> {
    let mut head = [0u8; HEADER_LEN];
    file.read_exact_at(&mut head, 0)
        .map_err(|e| format!("reading its header: {e}"))?;
    let header = FileHeader::decode(&head, model, geometry).map_err(|e| e.to_string())?;
    let mut tables = vec![0u8; header.tables_len() as usize];
    file.read_exact_at(&mut tables, HEADER_LEN as u64)
        .map_err(|e| format!("reading its tables: {e}"))?;
    let tables = header.decode_tables(&tables).map_err(|e| e.to_string())?;
    Ok((header, tables))
}

fn run(job: Job, model: u128, geometry: SnapshotGeometry, block: usize) -> DiskDone {
    match job {
        Job::Write { job, path } => {
            let to = job.to;
            let result = write_file(job, &path, model, geometry, block);
            DiskDone::Written { to, result }
        }
        Job::Read {
            from,
            to,
            path,
            into,
        } => {
            let started = std::time::Instant::now();
            let result = read_file(&path, &into, model, &geometry, block);
            let bytes: usize = into.iter().map(|r| r.len).sum();
            let took = started.elapsed().as_secs_f64();
            tracing::info!(
                "read {} ({:.2} GiB) back from disk in {:.0} ms ({:.1} GB/s, every block checked)",
                path.display(),
                bytes as f64 / (1u64 << 30) as f64,
                took * 1e3,
                bytes as f64 / took.max(1e-9) / 1e9
            );
            DiskDone::Read { from, to, result }
        }
    }
}

/// One piece of a payload: `len` bytes at `offset` in the payload, at `ptr` in memory.
#[derive(Clone, Copy)]
struct Piece {
    offset: u64,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: addresses of memory the job's owner keeps alive until the job is reported.
unsafe impl Send for Piece {}
unsafe impl Sync for Piece {}

/// Splits runs (whole blocks each) into pieces of at most [`PIECE_BYTES`], whole blocks.
fn pieces(runs: &[HostRun], block: usize) -> Vec<Piece> {
    let step = (PIECE_BYTES / block).max(1) * block;
    let mut out = Vec::new();
    let mut offset = 0u64;
    for run in runs {
        let mut at = 0;
        while at < run.len {
            let len = step.min(run.len - at);
            out.push(Piece {
                offset: offset + at as u64,
                ptr: run.ptr.wrapping_add(at),
                len,
            });
            at += len;
        }
        offset += run.len as u64;
    }
    out
}

/// Runs `work` on every piece from several threads; the first error wins.
fn on_threads(
    pieces: &[Piece],
    work: impl Fn(&Piece) -> Result<(), DiskFault> + Sync,
) -> Result<(), DiskFault> {
    let threads = std::thread::available_parallelism()
        .map_or(4, |n| n.get())
        .clamp(1, 16)
        .min(pieces.len().max(1));
    let next = AtomicUsize::new(0);
    let failure = std::sync::Mutex::new(None);
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(piece) = pieces.get(i) else { return };
                    if failure.lock().map_or(true, |f| f.is_some()) {
                        return;
                    }
                    if let Err(e) = work(piece) {
                        if let Ok(mut failure) = failure.lock() {
                            failure.get_or_insert(e);
                        }
                        return;
                    }
                }
            });
        }
    });
    match failure.into_inner() {
        Ok(Some(e)) => Err(e),
        Ok(None) => Ok(()),
        Err(_) => Err(DiskFault::Io("a disk thread panicked".into())),
    }
}

fn io<'a>(what: &'a str, path: &'a Path) -> impl Fn(std::io::Error) -> DiskFault + 'a {
    let what = what.to_string();
    move |e| DiskFault::Io(format!("{what} {}: {e}", path.display()))
}

fn write_file(
    job: WriteJob,
    path: &Path,
    model: u128,
    geometry: SnapshotGeometry,
    block: usize,
) -> Result<(), DiskFault> {
    let tables = FileTables {
        chain: job.chain.to_vec(),
        sums: job.sums,
    };
    let (header, encoded) =
        FileHeader::new(model, job.snapshot, geometry, &tables, job.kept, now_ms())
            .map_err(|e| DiskFault::Corrupt(e.to_string()))?;
    let runs = match &job.source {
        DiskSource::Runs(runs) => runs.clone(),
        DiskSource::Owned(bytes) => vec![HostRun {
            ptr: bytes.as_ptr().cast_mut(),
            len: bytes.len(),
        }],
    };
    let total: usize = runs.iter().map(|r| r.len).sum();
    if total as u64 != header.payload_bytes {
        return Err(DiskFault::Corrupt(format!(
            "{total} bytes in memory for a payload of {}",
            header.payload_bytes
        )));
    }
    let tmp = path.with_extension("tmp");
    let file = File::create(&tmp).map_err(io("creating", &tmp))?;
    let written = (|| {
        file.set_len(header.file_len())
            .map_err(io("sizing", &tmp))?;
        file.write_all_at(&header.encode(), 0)
            .map_err(io("writing", &tmp))?;
        file.write_all_at(&encoded, HEADER_LEN as u64)
            .map_err(io("writing", &tmp))?;
        let base = header.payload_offset();
        let sums = &tables.sums;
        on_threads(&pieces(&runs, block), |piece| {
            // SAFETY: the job's owner keeps this memory alive and unchanged until reported.
            let bytes = unsafe { std::slice::from_raw_parts(piece.ptr, piece.len) };
            let first = (piece.offset / block as u64) as usize;
            for (i, data) in bytes.chunks_exact(block).enumerate() {
                if block_sum(data) != sums[first + i] {
                    return Err(DiskFault::Corrupt(format!(
                        "block {} changed in memory since it was saved",
                        first + i
                    )));
                }
            }
            file.write_all_at(bytes, base + piece.offset)
                .map_err(io("writing", &tmp))
        })?;
        file.sync_data().map_err(io("syncing", &tmp))?;
        std::fs::rename(&tmp, path).map_err(io("renaming", &tmp))
    })();
    drop(job.source);
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

fn read_file(
    path: &Path,
    into: &[HostRun],
    model: u128,
    geometry: &SnapshotGeometry,
    block: usize,
) -> Result<FileTables, DiskFault> {
    let file = File::open(path).map_err(io("opening", path))?;
    let len = file.metadata().map_err(io("reading", path))?.len();
    let (header, tables) = read_header(&file, model, geometry).map_err(DiskFault::Corrupt)?;
    header
        .check_file_len(len)
        .map_err(|e| DiskFault::Corrupt(e.to_string()))?;
    let total: usize = into.iter().map(|r| r.len).sum();
    if total as u64 != header.payload_bytes {
        return Err(DiskFault::Io(format!(
            "a buffer of {total} bytes for a payload of {}",
            header.payload_bytes
        )));
    }
    let base = header.payload_offset();
    let sums = &tables.sums;
    on_threads(&pieces(into, block), |piece| {
        // SAFETY: the job's owner keeps this memory alive, and nothing else touches it, until
        // the read is reported.
        let bytes = unsafe { std::slice::from_raw_parts_mut(piece.ptr, piece.len) };
        file.read_exact_at(bytes, base + piece.offset)
            .map_err(io("reading", path))?;
        let first = (piece.offset / block as u64) as usize;
        for (i, data) in bytes.chunks_exact(block).enumerate() {
            if block_sum(data) != sums[first + i] {
                return Err(DiskFault::Corrupt(format!(
                    "block {} of {} does not match its sum",
                    first + i,
                    path.display()
                )));
            }
        }
        Ok(())
    })?;
    Ok(tables)
}
