//! Every kernel against a CPU reference on random inputs, outputs poisoned first (0xFF bytes:
//! NaN in any float type), so an element a kernel fails to write shows up. They need a GPU:
//! `cargo test --release -p engine --lib cuda -- --ignored` on the GPU machine.

use std::sync::Arc;

use cache::{KvGeometry, PageId};
use half::bf16;
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::device::{DPtr, Device, DeviceBuffer, PinnedBuffer};
use super::forward::{MAX_SPLITS, RESIDENT};
use super::gemm::{Gemm, Linear};
use super::kernels::*;
use super::pool::KvPool;
use super::step_meta::{LogitSelection, MetaCapacity, PackRequest, StepMeta};
use crate::backend::{LogitsWanted, RowPlan, StepPlan};

struct Gpu {
    device: Arc<Device>,
    kernels: Kernels,
}

fn gpu(head_dim: usize) -> Gpu {
    let device = Device::open(0).expect("these tests need a CUDA device");
    let kernels = Kernels::load(&device, head_dim).expect("the kernels compile and load");
    Gpu { device, kernels }
}

fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

fn uniform(rng: &mut ChaCha8Rng, n: usize, range: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-range..range)).collect()
}

/// Values rounded to bf16, as the device will see them.
fn round_bf16(values: &[f32]) -> Vec<f32> {
    values.iter().map(|&v| bf16::from_f32(v).to_f32()).collect()
}

impl Gpu {
    fn upload<T: Copy>(&self, values: &[T]) -> DeviceBuffer {
        let buffer =
            DeviceBuffer::alloc(&self.device, std::mem::size_of_val(values), "test").unwrap();
        self.device.upload(values, buffer.ptr()).unwrap();
        buffer
    }

    fn upload_bf16(&self, values: &[f32]) -> DeviceBuffer {
        let bits: Vec<bf16> = values.iter().map(|&v| bf16::from_f32(v)).collect();
        self.upload(&bits)
    }

    /// A buffer of `bytes` 0xFF bytes.
    fn poisoned(&self, bytes: usize) -> DeviceBuffer {
        self.upload(&vec![0xFFu8; bytes])
    }

    fn download<T: Copy + Default>(&self, ptr: DPtr<T>, n: usize) -> Vec<T> {
        self.device.synchronize().unwrap();
        let mut out = vec![T::default(); n];
        self.device.download(ptr, &mut out).unwrap();
        out
    }

    fn download_bf16(&self, ptr: DPtr<bf16>, n: usize) -> Vec<f32> {
        self.download(ptr, n).iter().map(|v| v.to_f32()).collect()
    }
}

/// Max absolute error and RMS error relative to the reference's RMS; NaN anywhere fails.
fn compare(got: &[f32], want: &[f32]) -> (f64, f64) {
    assert_eq!(got.len(), want.len());
    let (mut max, mut err, mut norm) = (0f64, 0f64, 0f64);
    for (&g, &w) in got.iter().zip(want) {
        assert!(
            g.is_finite(),
            "a non-finite output ({g}): an element was not written"
        );
        let d = (g as f64 - w as f64).abs();
        max = max.max(d);
        err += d * d;
        norm += (w as f64) * (w as f64);
    }
    (max, (err / norm.max(1e-30)).sqrt())
}

fn assert_close(what: &str, got: &[f32], want: &[f32], rel_rms: f64) {
    let (max, rel) = compare(got, want);
    println!("{what}: max abs error {max:.3e}, relative RMS {rel:.3e}");
    assert!(
        rel <= rel_rms,
        "{what}: relative RMS {rel:.3e} above {rel_rms:.1e}"
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn embed_gathers_rows() {
    let g = gpu(64);
    let (vocab, hidden) = (300, 96);
    let table = round_bf16(&uniform(&mut rng(1), vocab * hidden, 2.0));
    let ids: Vec<u32> = vec![7, 299, 0, 7, 150];
    let table_d = g.upload_bf16(&table);
    let ids_d = g.upload(&ids);
    let out = g.poisoned(ids.len() * hidden * 4);
    g.kernels
        .embed(&Embed {
            table: table_d.ptr(),
            token_ids: ids_d.ptr(),
            residual: out.ptr(),
            tokens: ids.len(),
            hidden,
            split: None,
        })
        .unwrap();
    let got = g.download(out.ptr::<f32>(), ids.len() * hidden);
    let want: Vec<f32> = ids
        .iter()
        .flat_map(|&t| table[t as usize * hidden..(t as usize + 1) * hidden].to_vec())
        .collect();
    assert_eq!(got, want);
}

/// A rank of a split model holds vocabulary rows 100..200: the tokens it holds get their rows,
/// the others zeros (the first and last rows held, one before and one after included), and the
/// residual is zeroed for the all-reduce to fill.
#[test]
#[ignore = "needs a CUDA device"]
fn a_split_embedding_gathers_only_the_rows_its_rank_holds() {
    let g = gpu(64);
    let (rows, hidden) = (100..200usize, 96);
    let table = round_bf16(&uniform(&mut rng(2), rows.len() * hidden, 2.0));
    let ids: Vec<u32> = vec![99, 100, 150, 199, 200, 0, 299];
    let table_d = g.upload_bf16(&table);
    let ids_d = g.upload(&ids);
    let residual = g.poisoned(ids.len() * hidden * 4);
    let slice = g.poisoned(ids.len() * hidden * 2);
    g.kernels
        .embed(&Embed {
            table: table_d.ptr(),
            token_ids: ids_d.ptr(),
            residual: residual.ptr(),
            tokens: ids.len(),
            hidden,
            split: Some((slice.ptr(), rows.clone())),
        })
        .unwrap();
    let got = g.download_bf16(slice.ptr(), ids.len() * hidden);
    let want: Vec<f32> = ids
        .iter()
        .flat_map(|&t| match t as usize {
            t if rows.contains(&t) => {
                let r = t - rows.start;
                table[r * hidden..(r + 1) * hidden].to_vec()
            }
            _ => vec![0.0; hidden],
        })
        .collect();
    assert_eq!(got, want);
    let zeros = g.download(residual.ptr::<f32>(), ids.len() * hidden);
    assert!(zeros.iter().all(|&v| v == 0.0));
}

#[test]
#[ignore = "needs a CUDA device"]
fn add_rms_norm_adds_normalizes_and_packs_rows() {
    let g = gpu(64);
    let (tokens, hidden, eps) = (5, 576, 1e-5f32);
    let mut r = rng(2);
    let x = uniform(&mut r, tokens * hidden, 3.0);
    let delta = round_bf16(&uniform(&mut r, tokens * hidden, 1.0));
    let weight = round_bf16(&uniform(&mut r, hidden, 1.5));
    let out_rows = [2, NO_ROW, 0, NO_ROW, 1];
    let (x_d, delta_d, w_d, rows_d) = (
        g.upload(&x),
        g.upload_bf16(&delta),
        g.upload_bf16(&weight),
        g.upload(&out_rows),
    );
    let out = g.poisoned(tokens * hidden * 2);
    g.kernels
        .add_rms_norm(&AddRmsNorm {
            residual: x_d.ptr(),
            delta: delta_d.ptr(),
            weight: w_d.ptr(),
            out: out.ptr(),
            out_rows: rows_d.ptr(),
            e4m3: None,
            tokens,
            hidden,
            eps,
        })
        .unwrap();
    let sum: Vec<f32> = x.iter().zip(&delta).map(|(a, b)| a + b).collect();
    assert_eq!(g.download(x_d.ptr::<f32>(), tokens * hidden), sum);
    let mut want = Vec::new();
    for t in [2, 4, 0] {
        let row = &sum[t * hidden..(t + 1) * hidden];
        let ms = row.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / hidden as f64;
        let scale = 1.0 / (ms + eps as f64).sqrt();
        want.extend(
            row.iter()
                .zip(&weight)
                .map(|(v, w)| (*v as f64 * scale * *w as f64) as f32),
        );
    }
    let got = g.download_bf16(out.ptr(), tokens * hidden);
    assert_close("add_rms_norm", &got[..3 * hidden], &want, 4e-3);
    assert!(
        got[3 * hidden..].iter().all(|v| v.is_nan()),
        "rows 3.. are not anyone's"
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn silu_mul_gates() {
    let g = gpu(64);
    // Rows whose width is a multiple of 8 (eight elements a thread) and one that is not.
    for (tokens, ffn) in [(7, 1536), (3, 1540), (1, 14336)] {
        let gate_up = round_bf16(&uniform(&mut rng(3), tokens * 2 * ffn, 6.0));
        let input = g.upload_bf16(&gate_up);
        // Twice the output's bytes: the second half must stay poisoned.
        let out = g.poisoned(tokens * ffn * 4);
        g.kernels
            .silu_mul(input.ptr(), out.ptr(), tokens, ffn)
            .unwrap();
        let want: Vec<f32> = (0..tokens * ffn)
            .map(|i| {
                let (t, j) = (i / ffn, i % ffn);
                let (gv, u) = (
                    gate_up[t * 2 * ffn + j] as f64,
                    gate_up[t * 2 * ffn + ffn + j] as f64,
                );
                (gv / (1.0 + (-gv).exp()) * u) as f32
            })
            .collect();
        let got = g.download_bf16(out.ptr(), tokens * ffn * 2);
        assert_close(
            &format!("silu_mul {tokens}x{ffn}"),
            &got[..tokens * ffn],
            &want,
            4e-3,
        );
        assert!(
            got[tokens * ffn..].iter().all(|v| v.is_nan()),
            "silu_mul {tokens}x{ffn} wrote past its rows"
        );
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn rope_rotates_q_and_appends_k_v_to_their_slots() {
    let g = gpu(64);
    // Every head size the kernels serve (a thread takes 8 pairs: a head of 16 has one such
    // unit a half), grouped and not.
    for (heads, kv_heads, d) in [(6, 2, 64), (4, 4, 16), (3, 1, 32), (8, 2, 128)] {
        rope_case(&g, heads, kv_heads, d);
    }
}

fn rope_case(g: &Gpu, heads: usize, kv_heads: usize, d: usize) {
    let shape = AttnShape {
        heads,
        kv_heads,
        head_dim: d,
        page_tokens: 16,
        window: 0,
    };
    let (tokens, width, half) = (4, shape.qkv_width(), d / 2);
    let mut r = rng(4 + d as u64);
    let qkv = round_bf16(&uniform(&mut r, tokens * width, 2.0));
    let bias = round_bf16(&uniform(&mut r, width, 0.5));
    let inv_freq: Vec<f32> = (0..half)
        .map(|i| 1.0 / 10000f32.powf(2.0 * i as f32 / d as f32))
        .collect();
    let positions = [0u32, 5, 1000, 77];
    let slots = [3u32, 17, 40, 9];
    let slots_total = 48;
    let (qkv_d, bias_d, freq_d, pos_d, slot_d) = (
        g.upload_bf16(&qkv),
        g.upload_bf16(&bias),
        g.upload(&inv_freq),
        g.upload(&positions),
        g.upload(&slots),
    );
    let cache_elems = slots_total * shape.kv_heads * d;
    let (k, v) = (g.poisoned(cache_elems * 2), g.poisoned(cache_elems * 2));
    g.kernels
        .rope_kv_append(&RopeKv {
            qkv: qkv_d.ptr(),
            bias: bias_d.ptr(),
            inv_freq: freq_d.ptr(),
            positions: pos_d.ptr(),
            slots: slot_d.ptr(),
            k_cache: k.ptr(),
            v_cache: v.ptr(),
            shape,
            tokens,
            write_q: true,
        })
        .unwrap();
    let (mut want_q, mut want_k, mut want_v) = (Vec::new(), Vec::new(), Vec::new());
    let (mut got_k, mut got_v) = (Vec::new(), Vec::new());
    let (k_all, v_all) = (
        g.download_bf16(k.ptr(), cache_elems),
        g.download_bf16(v.ptr(), cache_elems),
    );
    for t in 0..tokens {
        let row: Vec<f64> = (0..width)
            .map(|i| (qkv[t * width + i] + bias[i]) as f64)
            .collect();
        let rotated = |head: usize| -> Vec<f32> {
            let h = &row[head * d..(head + 1) * d];
            let mut out = vec![0f32; d];
            for i in 0..half {
                let angle = (positions[t] as f32 * inv_freq[i]) as f64;
                out[i] = (h[i] * angle.cos() - h[i + half] * angle.sin()) as f32;
                out[i + half] = (h[i + half] * angle.cos() + h[i] * angle.sin()) as f32;
            }
            out
        };
        (0..shape.heads).for_each(|h| want_q.extend(rotated(h)));
        (0..shape.kv_heads).for_each(|h| want_k.extend(rotated(shape.heads + h)));
        let v_at = (shape.heads + shape.kv_heads) * d;
        want_v.extend(row[v_at..].iter().map(|&x| x as f32));
        let at = slots[t] as usize * shape.kv_heads * d;
        got_k.extend_from_slice(&k_all[at..at + shape.kv_heads * d]);
        got_v.extend_from_slice(&v_all[at..at + shape.kv_heads * d]);
    }
    let q_all = g.download_bf16(qkv_d.ptr(), tokens * width);
    let got_q: Vec<f32> = (0..tokens)
        .flat_map(|t| q_all[t * width..t * width + shape.heads * d].to_vec())
        .collect();
    assert_close(&format!("rope q, head {d}"), &got_q, &want_q, 4e-3);
    assert_close(&format!("rope k, head {d}"), &got_k, &want_k, 4e-3);
    assert_close(&format!("appended v, head {d}"), &got_v, &want_v, 4e-3);
    let written = tokens * shape.kv_heads * d;
    assert_eq!(
        k_all.iter().filter(|x| x.is_nan()).count(),
        cache_elems - written
    );

    // Without q (a verification's append, before the decode kernel rotates q itself): the same
    // k and v bytes, q as it was.
    let qkv_again = g.upload_bf16(&qkv);
    let (k2, v2) = (g.poisoned(cache_elems * 2), g.poisoned(cache_elems * 2));
    g.kernels
        .rope_kv_append(&RopeKv {
            qkv: qkv_again.ptr(),
            bias: bias_d.ptr(),
            inv_freq: freq_d.ptr(),
            positions: pos_d.ptr(),
            slots: slot_d.ptr(),
            k_cache: k2.ptr(),
            v_cache: v2.ptr(),
            shape,
            tokens,
            write_q: false,
        })
        .unwrap();
    let bits = |xs: Vec<f32>| xs.into_iter().map(f32::to_bits).collect::<Vec<_>>();
    assert_eq!(bits(g.download_bf16(k2.ptr(), cache_elems)), bits(k_all));
    assert_eq!(bits(g.download_bf16(v2.ptr(), cache_elems)), bits(v_all));
    assert_eq!(
        bits(g.download_bf16(qkv_again.ptr(), tokens * width)),
        bits(qkv.clone())
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn gemm_projects_rows_in_bf16_and_f32() {
    let g = gpu(64);
    let gemm = Gemm::new(&g.device).unwrap();
    let (tokens, inf, outf) = (5, 576, 1000);
    let mut r = rng(5);
    let x = round_bf16(&uniform(&mut r, tokens * inf, 1.0));
    let w = round_bf16(&uniform(&mut r, outf * inf, 0.1));
    let (x_d, w_d) = (g.upload_bf16(&x), g.upload_bf16(&w));
    let want: Vec<f32> = (0..tokens * outf)
        .map(|i| {
            let (t, o) = (i / outf, i % outf);
            (0..inf)
                .map(|k| x[t * inf + k] as f64 * w[o * inf + k] as f64)
                .sum::<f64>() as f32
        })
        .collect();
    let shape = Linear {
        tokens,
        in_features: inf,
        out_features: outf,
    };
    // Both products against the reference, outputs poisoned first.
    let check = |gemm: &Gemm, after: &str| {
        let y16 = g.poisoned(tokens * outf * 2);
        gemm.linear(x_d.ptr(), w_d.ptr(), y16.ptr(), shape).unwrap();
        let got = g.download_bf16(y16.ptr(), tokens * outf);
        assert_close(&format!("gemm bf16{after}"), &got, &want, 4e-3);
        let y32 = g.poisoned(tokens * outf * 4);
        gemm.linear_f32(x_d.ptr(), w_d.ptr(), y32.ptr(), shape)
            .unwrap();
        let got = g.download(y32.ptr(), tokens * outf);
        assert_close(&format!("gemm f32{after}"), &got, &want, 1e-5);
    };
    check(&gemm, "");
    // The bf16 product on the cuBLASLt algorithm tuning picks, kept whatever it costs; the f32
    // logits, a shape tuning did not see, still on the default.
    let mut gemm = gemm;
    let scratch = g.poisoned(tokens * outf * 2);
    let tuned = gemm
        .tune_keeping(
            &g.device,
            &[(shape, vec![w_d.ptr()])],
            x_d.ptr(),
            scratch.ptr(),
            f64::NEG_INFINITY,
        )
        .unwrap();
    assert!(tuned[0].kept, "no cuBLASLt candidate ran: {tuned:?}");
    check(&gemm, " after tuning");
}

/// Rows of `cols` values with the spreads FP8 meets: uniform rows, a row of zeros, a row with
/// one outlier far above the rest (its small values go subnormal or to zero), tiny values.
fn fp8_rows(r: &mut ChaCha8Rng, rows: usize, cols: usize) -> Vec<f32> {
    let mut x = Vec::with_capacity(rows * cols);
    for row in 0..rows {
        let mut values = match row % 4 {
            0 => uniform(r, cols, 1.0),
            1 if row == 1 => vec![0.0; cols],
            1 => uniform(r, cols, 1e-3),
            2 => uniform(r, cols, 0.05),
            _ => uniform(r, cols, 30.0),
        };
        if row % 4 == 2 {
            values[cols / 3] = 900.0;
        }
        x.extend(round_bf16(&values));
    }
    x
}

#[test]
#[ignore = "needs a CUDA device"]
fn quantize_rows_e4m3_matches_the_reference_bit_for_bit() {
    use super::fp8::quantize_row;
    let g = gpu(64);
    let mut r = rng(8);
    for (rows, cols) in [(1, 8), (6, 576), (5, 1536), (3, 14336), (9, 4104)] {
        let x = fp8_rows(&mut r, rows, cols);
        let x_d = g.upload_bf16(&x);
        let (q_d, s_d) = (g.poisoned(rows * cols), g.poisoned(rows * 4));
        g.kernels
            .quantize_rows_e4m3(x_d.ptr(), e4m3_rows(&q_d, &s_d), rows, cols)
            .unwrap();
        let (q, scales) = (
            g.download::<u8>(q_d.ptr(), rows * cols),
            g.download::<f32>(s_d.ptr(), rows),
        );
        for row in 0..rows {
            let (want_q, want_scale) = quantize_row(&x[row * cols..(row + 1) * cols]);
            assert_eq!(
                scales[row], want_scale,
                "{rows} x {cols}: row {row}'s scale"
            );
            let got = &q[row * cols..(row + 1) * cols];
            if let Some(i) = (0..cols).find(|&i| got[i] != want_q[i]) {
                panic!(
                    "{rows} x {cols}: row {row}, element {i} ({}): {:#04x}, want {:#04x}",
                    x[row * cols + i],
                    got[i],
                    want_q[i]
                );
            }
        }
    }
}

/// FP8 rows whose values are in `q` and scales in `scales`.
fn e4m3_rows(q: &DeviceBuffer, scales: &DeviceBuffer) -> Fp8Rows {
    Fp8Rows {
        values: q.ptr(),
        scales: scales.ptr(),
    }
}

/// The FP8 rows and scales a kernel wrote: `(values, scales)`.
fn fp8_download(
    g: &Gpu,
    q: &DeviceBuffer,
    scales: &DeviceBuffer,
    rows: usize,
    cols: usize,
) -> (Vec<u8>, Vec<f32>) {
    (
        g.download::<u8>(q.ptr(), rows * cols),
        g.download::<f32>(scales.ptr(), rows),
    )
}

#[test]
#[ignore = "needs a CUDA device"]
fn norm_and_silu_write_fp8_rows_as_the_separate_pass_would() {
    let g = gpu(64);
    let mut r = rng(12);
    // add_rms_norm: SmolLM2's and Llama's widths, one with fewer chunks than threads a block.
    for (tokens, hidden) in [(3, 576), (5, 4096), (2, 8192), (1, 64)] {
        let x = uniform(&mut r, tokens * hidden, 3.0);
        let delta = round_bf16(&uniform(&mut r, tokens * hidden, 1.0));
        let weight = round_bf16(&uniform(&mut r, hidden, 1.5));
        let (w_d, delta_d) = (g.upload_bf16(&weight), g.upload_bf16(&delta));
        let norm = |e4m3, out: &DeviceBuffer| {
            let x_d = g.upload(&x);
            g.kernels
                .add_rms_norm(&AddRmsNorm {
                    residual: x_d.ptr(),
                    delta: delta_d.ptr(),
                    weight: w_d.ptr(),
                    out: out.ptr(),
                    out_rows: DPtr::NULL,
                    e4m3,
                    tokens,
                    hidden,
                    eps: 1e-5,
                })
                .unwrap();
            g.download::<f32>(x_d.ptr(), tokens * hidden)
        };
        let normed = g.poisoned(tokens * hidden * 2);
        let plain_residual = norm(None, &normed);
        let (want_q, want_s) = (g.poisoned(tokens * hidden), g.poisoned(tokens * 4));
        g.kernels
            .quantize_rows_e4m3(normed.ptr(), e4m3_rows(&want_q, &want_s), tokens, hidden)
            .unwrap();
        let untouched = g.poisoned(tokens * hidden * 2);
        let (q, s) = (g.poisoned(tokens * hidden), g.poisoned(tokens * 4));
        let fused_residual = norm(Some(e4m3_rows(&q, &s)), &untouched);
        assert_eq!(
            fused_residual, plain_residual,
            "{tokens} x {hidden}: the residual add"
        );
        assert_eq!(
            fp8_download(&g, &q, &s, tokens, hidden),
            fp8_download(&g, &want_q, &want_s, tokens, hidden),
            "add_rms_norm {tokens} x {hidden} into FP8"
        );
        assert!(
            g.download_bf16(untouched.ptr(), tokens * hidden)
                .iter()
                .all(|v| v.is_nan()),
            "add_rms_norm into FP8 wrote bf16 rows too"
        );
    }
    // silu_mul: SmolLM2's, Llama-3.1-8B's and the widest a block holds.
    for (tokens, ffn) in [(7, 1536), (3, 14336), (1, SILU_E4M3_MAX_FFN)] {
        let gate_up = round_bf16(&uniform(&mut r, tokens * 2 * ffn, 6.0));
        let input = g.upload_bf16(&gate_up);
        let out = g.poisoned(tokens * ffn * 2);
        g.kernels
            .silu_mul(input.ptr(), out.ptr(), tokens, ffn)
            .unwrap();
        let (want_q, want_s) = (g.poisoned(tokens * ffn), g.poisoned(tokens * 4));
        g.kernels
            .quantize_rows_e4m3(out.ptr(), e4m3_rows(&want_q, &want_s), tokens, ffn)
            .unwrap();
        // One byte a row past the end stays poisoned.
        let (q, s) = (g.poisoned(tokens * ffn + 1), g.poisoned(tokens * 4));
        g.kernels
            .silu_mul_e4m3(input.ptr(), e4m3_rows(&q, &s), tokens, ffn)
            .unwrap();
        assert_eq!(
            fp8_download(&g, &q, &s, tokens, ffn),
            fp8_download(&g, &want_q, &want_s, tokens, ffn),
            "silu_mul_e4m3 {tokens} x {ffn}"
        );
        let past = g.download::<u8>(q.ptr(), tokens * ffn + 1)[tokens * ffn];
        assert_eq!(
            past, 0xFF,
            "silu_mul_e4m3 {tokens} x {ffn} wrote past its rows"
        );
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn fp8_products_match_the_dequantized_reference() {
    use super::fp8::{e4m3_to_f32, quantize_row};
    let g = gpu(64);
    let mut gemm = Gemm::new(&g.device).unwrap();
    let mut r = rng(9);
    for (tokens, inf, outf) in [
        (1, 576, 1000),
        (5, 576, 960),
        (64, 1536, 576),
        (300, 4096, 512),
    ] {
        let x = round_bf16(&uniform(&mut r, tokens * inf, 1.0));
        let w = fp8_rows(&mut r, outf, inf);
        let (x_d, w_d) = (g.upload_bf16(&x), g.upload_bf16(&w));
        let (x8, xs) = (g.poisoned(tokens * inf), g.poisoned(tokens * 4));
        let (w8, ws) = (g.poisoned(outf * inf), g.poisoned(outf * 4));
        g.kernels
            .quantize_rows_e4m3(x_d.ptr(), e4m3_rows(&x8, &xs), tokens, inf)
            .unwrap();
        g.kernels
            .quantize_rows_e4m3(w_d.ptr(), e4m3_rows(&w8, &ws), outf, inf)
            .unwrap();
        let shape = Linear {
            tokens,
            in_features: inf,
            out_features: outf,
        };
        let y = g.poisoned(tokens * outf * 2);
        gemm.linear_fp8(x8.ptr(), xs.ptr(), w8.ptr(), ws.ptr(), y.ptr(), shape)
            .unwrap();
        let got = g.download_bf16(y.ptr(), tokens * outf);
        let dequantized = |values: &[f32], rows: usize| -> Vec<f64> {
            (0..rows)
                .flat_map(|row| {
                    let (q, scale) = quantize_row(&values[row * inf..(row + 1) * inf]);
                    q.into_iter()
                        .map(move |c| e4m3_to_f32(c) as f64 * scale as f64)
                })
                .collect()
        };
        let (xq, wq) = (dequantized(&x, tokens), dequantized(&w, outf));
        let want: Vec<f32> = (0..tokens * outf)
            .map(|i| {
                let (t, o) = (i / outf, i % outf);
                (0..inf)
                    .map(|k| xq[t * inf + k] * wq[o * inf + k])
                    .sum::<f64>() as f32
            })
            .collect();
        // bf16 outputs and cuBLASLt's fast accumulation.
        let what = format!("fp8 {tokens} x {inf} -> {outf}");
        assert_close(&what, &got, &want, 8e-3);
        // Start-up's tuning times cuBLASLt's other candidates; whichever it keeps computes
        // the same product.
        let scratch = (g.poisoned(tokens * inf), g.poisoned(tokens * 4));
        let y_scratch = g.poisoned(tokens * outf * 2);
        let tuned = gemm
            .tune_fp8(
                &g.device,
                &[(shape, vec![(w8.ptr(), ws.ptr())])],
                (scratch.0.ptr(), scratch.1.ptr()),
                y_scratch.ptr(),
            )
            .unwrap();
        println!("{what} tuned: {tuned:?}");
        let y_tuned = g.poisoned(tokens * outf * 2);
        gemm.linear_fp8(x8.ptr(), xs.ptr(), w8.ptr(), ws.ptr(), y_tuned.ptr(), shape)
            .unwrap();
        let tuned_got = g.download_bf16(y_tuned.ptr(), tokens * outf);
        assert_close(&format!("{what}, tuned"), &tuned_got, &want, 8e-3);
        // And what the quantization itself costs against the bf16 product: a few percent.
        let exact = reference_product(&x, &w, tokens, inf, outf);
        let exact: Vec<f32> = exact.iter().map(|&v| v as f32).collect();
        let (_, rel) = compare(&got, &exact);
        println!("fp8 {tokens} x {inf} -> {outf}: relative RMS against bf16 {rel:.2e}");
        assert!(
            rel < 0.1,
            "fp8 {tokens} x {inf} -> {outf}: {rel} from the bf16 product"
        );
    }
}

/// The CUDA-core gemv, or the tensor-core one with `tc`.
#[allow(clippy::type_complexity)]
fn gemv(
    g: &Gpu,
    tc: bool,
) -> impl Fn(GemvInput, DPtr<bf16>, GemvOutput, Linear) -> crate::error::Result<()> + '_ {
    move |input, w, output, shape| {
        if tc {
            g.kernels.gemv_tc(input, w, output, shape)
        } else {
            g.kernels.gemv(input, w, output, shape)
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn gemv_matches_reference_for_few_tokens() {
    let g = gpu(64);
    for ((tokens, inf, outf), tc) in [(1, 576, 960), (3, 4096, 301), (8, 1536, 576), (2, 64, 7)]
        .into_iter()
        .flat_map(|shape| [(shape, false), (shape, true)])
    {
        let mut r = rng(12 + tokens as u64);
        let x = round_bf16(&uniform(&mut r, tokens * inf, 1.0));
        let w = round_bf16(&uniform(&mut r, outf * inf, 0.1));
        let (x_d, w_d) = (g.upload_bf16(&x), g.upload_bf16(&w));
        let y = g.poisoned(tokens * outf * 2);
        let shape = Linear {
            tokens,
            in_features: inf,
            out_features: outf,
        };
        gemv(&g, tc)(
            GemvInput::Rows(x_d.ptr()),
            w_d.ptr(),
            GemvOutput::Rows(y.ptr()),
            shape,
        )
        .unwrap();
        let want: Vec<f32> = reference_product(&x, &w, tokens, inf, outf)
            .into_iter()
            .map(|v| v as f32)
            .collect();
        let got = g.download_bf16(y.ptr(), tokens * outf);
        let what = if tc { "gemv_tc" } else { "gemv" };
        assert_close(
            &format!("{what} {tokens}x{inf} by {outf}"),
            &got,
            &want,
            4e-3,
        );
    }
}

/// One token's logits through the gemv into f32 rows (a small model's vocabulary projection),
/// unrounded: within f32 summation error of the f64 reference, every output written.
#[test]
#[ignore = "needs a CUDA device"]
fn gemv_writes_one_tokens_f32_logits() {
    let g = gpu(64);
    for (inf, outf) in [(576, 49_152), (64, 13)] {
        let mut r = rng(31 + outf as u64);
        let x = round_bf16(&uniform(&mut r, inf, 1.0));
        let w = round_bf16(&uniform(&mut r, outf * inf, 0.1));
        let (x_d, w_d) = (g.upload_bf16(&x), g.upload_bf16(&w));
        let y = g.poisoned(outf * 4);
        let shape = Linear {
            tokens: 1,
            in_features: inf,
            out_features: outf,
        };
        g.kernels
            .gemv(
                GemvInput::Rows(x_d.ptr()),
                w_d.ptr(),
                GemvOutput::F32(y.ptr()),
                shape,
            )
            .unwrap();
        let want: Vec<f32> = reference_product(&x, &w, 1, inf, outf)
            .into_iter()
            .map(|v| v as f32)
            .collect();
        let got = g.download(y.ptr(), outf);
        assert_close(&format!("gemv f32 1x{inf} by {outf}"), &got, &want, 1e-5);
    }
}

/// The FP8 gemv (e4m3 weights with a scale a row, bf16 inputs) with each of its fusions, against
/// the references on the weights it holds: each row's e4m3 values times its scale.
#[test]
#[ignore = "needs a CUDA device (sm_89 or newer)"]
fn gemv_fp8_matches_the_reference_with_every_fusion() {
    use super::fp8::{e4m3_to_f32, quantize_row};
    let g = gpu(64);
    let eps = 1e-5;
    for (tokens, inf, outf) in [(1, 576, 960), (3, 4096, 302), (8, 1536, 576), (5, 64, 8)] {
        let mut r = rng(70 + tokens as u64);
        let residual = uniform(&mut r, tokens * inf, 2.0);
        let norm_weight = round_bf16(&uniform(&mut r, inf, 1.5));
        let w = fp8_rows(&mut r, outf, inf);
        let x = round_bf16(&uniform(&mut r, tokens * inf, 1.0));
        let (residual_d, norm_d) = (g.upload(&residual), g.upload_bf16(&norm_weight));
        let (w_d, x_d) = (g.upload_bf16(&w), g.upload_bf16(&x));
        let (w8, scales) = (g.poisoned(outf * inf), g.poisoned(outf * 4));
        g.kernels
            .quantize_rows_e4m3(w_d.ptr(), e4m3_rows(&w8, &scales), outf, inf)
            .unwrap();
        let held: Vec<f32> = w
            .chunks(inf)
            .flat_map(|row| {
                let (q, scale) = quantize_row(row);
                q.into_iter().map(move |c| e4m3_to_f32(c) * scale)
            })
            .collect();
        let gemv = |input, output| {
            let shape = Linear {
                tokens,
                in_features: inf,
                out_features: outf,
            };
            g.kernels
                .gemv_fp8(input, w8.ptr(), scales.ptr(), output, shape)
                .unwrap()
        };
        let what = |mode: &str| format!("FP8 {mode} {tokens}x{inf} by {outf}");
        let normed = GemvInput::Normed {
            residual: residual_d.ptr(),
            weight: norm_d.ptr(),
            eps,
        };
        let rows = GemvInput::Rows(x_d.ptr());
        let plain = reference_product(&x, &held, tokens, inf, outf);
        let of_norm = reference_product(
            &reference_norm(&residual, &norm_weight, inf, eps),
            &held,
            tokens,
            inf,
            outf,
        );
        for (mode, input, product) in [("gemv", rows, &plain), ("gemv_norm", normed, &of_norm)] {
            let y = g.poisoned(tokens * outf * 2);
            gemv(input, GemvOutput::Rows(y.ptr()));
            let want: Vec<f32> = product.iter().map(|&v| v as f32).collect();
            let got = g.download_bf16(y.ptr(), tokens * outf);
            assert_close(&what(mode), &got, &want, 4e-3);
        }
        let f = outf / 2;
        let glu = |product: &[f64]| reference_glu(product, tokens, outf);
        for (mode, input, product) in [("glu", rows, &plain), ("norm_glu", normed, &of_norm)] {
            let y = g.poisoned(tokens * f * 2);
            gemv(input, GemvOutput::Glu(y.ptr()));
            let got = g.download_bf16(y.ptr(), tokens * f);
            assert_close(&what(mode), &got, &glu(product), 8e-3);
        }
        let stream = uniform(&mut r, tokens * outf, 3.0);
        let stream_d = g.upload(&stream);
        gemv(rows, GemvOutput::Accumulate(stream_d.ptr()));
        let want: Vec<f32> = stream
            .iter()
            .zip(&plain)
            .map(|(&s, &p)| s + bf16::from_f64(p).to_f32())
            .collect();
        let got = g.download(stream_d.ptr::<f32>(), tokens * outf);
        assert_close(&what("accum"), &got, &want, 1e-3);
    }
}

/// `Σ_k x[t][k] · w[o][k]` in f64, for every token and output.
/// A folded layer's two launches (gemv_fold.cu) against a reference in f64 over the same bf16
/// weights and inputs: the A rows' raw products of `[h ; a]` (for the q/k/v and down launch,
/// of s, the activation of the raw gate/up scaled by the norm its partial sums give, added to
/// a given part), the B rows' stream `before + bf16(w·input)`, and each B block's sum of its
/// outputs' squares.
/// Shapes: SmolLM2's, and a small one whose A rows do not fill their last block.
#[test]
#[ignore = "needs a CUDA device"]
fn gemv_fold_matches_the_reference() {
    let g = gpu(64);
    let eps = 1e-5f32;
    for (hidden, q_dim, ffn, qkv_rows) in [(576, 576, 1536, 960), (64, 128, 40, 13)] {
        for phase in [FoldPhase::GateUpOut, FoldPhase::QkvDown] {
            let mut r = rng(90 + hidden as u64 + phase as u64);
            let qkvd = phase == FoldPhase::QkvDown;
            let (rows_a, b_in) = if qkvd {
                (qkv_rows, ffn)
            } else {
                (2 * ffn, q_dim)
            };
            let a_in = if qkvd { ffn } else { hidden + q_dim };
            let h = uniform(&mut r, hidden, 2.0);
            let before = uniform(&mut r, hidden, 2.0);
            let a = round_bf16(&uniform(&mut r, q_dim, 1.0));
            let gu = uniform(&mut r, 2 * ffn, 3.0);
            let partial = uniform(&mut r, rows_a, 2.0);
            let gu_parts: Vec<f32> = (0..hidden / FOLD_ROWS)
                .map(|_| r.random_range(0.5f32..4.0))
                .collect();
            let wa = round_bf16(&uniform(&mut r, rows_a * a_in, 0.1));
            let wb = round_bf16(&uniform(&mut r, hidden * b_in, 0.1));
            // The activation every block computes, rounded as it rounds.
            let scale = {
                let sum: f32 = gu_parts.iter().sum();
                1.0 / (sum / hidden as f32 + eps).sqrt()
            };
            let scaled: Vec<f64> = gu.iter().map(|&v| (v * scale) as f64).collect();
            let s = round_bf16(&reference_glu(&scaled, 1, 2 * ffn));
            let bf = |v: f32| bf16::from_f32(v).to_f32();
            let input_a: Vec<f32> = if qkvd {
                s.clone()
            } else {
                [h.clone(), a.clone()].concat()
            };
            let input_b = if qkvd { s.clone() } else { a.clone() };
            let stream_before = if qkvd { &before } else { &h };
            let want_raw = reference_product(&input_a, &wa, 1, a_in, rows_a);
            let want_after: Vec<f32> = reference_product(&input_b, &wb, 1, b_in, hidden)
                .iter()
                .zip(stream_before)
                .map(|(&v, &x)| x + bf(v as f32))
                .collect();
            let want_parts: Vec<f32> = want_after
                .chunks(FOLD_ROWS)
                .map(|c| c.iter().map(|&v| v as f64 * v as f64).sum::<f64>() as f32)
                .collect();
            let (h_d, before_d, a_d) = (g.upload(&h), g.upload(&before), g.upload_bf16(&a));
            let (gu_d, gu_parts_d) = (g.upload(&gu), g.upload(&gu_parts));
            let partial_d = g.upload(&partial);
            let (wa_d, wb_d) = (g.upload_bf16(&wa), g.upload_bf16(&wb));
            let raw = g.poisoned(rows_a * 4);
            let after = g.poisoned(hidden * 4);
            let parts = g.poisoned(hidden / FOLD_ROWS * 4);
            g.kernels
                .gemv_fold(&FoldLaunch {
                    phase,
                    h: h_d.ptr(),
                    a: a_d.ptr(),
                    gu: gu_d.ptr(),
                    gu_parts: gu_parts_d.ptr(),
                    partial: partial_d.ptr(),
                    before: if qkvd { before_d.ptr() } else { h_d.ptr() },
                    wa: wa_d.ptr(),
                    rows_a,
                    raw: raw.ptr(),
                    wb: wb_d.ptr(),
                    after: after.ptr(),
                    parts: parts.ptr(),
                    hidden,
                    q_dim,
                    ffn,
                    eps,
                })
                .unwrap();
            let what = format!("gemv_fold {phase:?} hidden {hidden} q {q_dim} ffn {ffn}");
            let want_raw: Vec<f32> = want_raw
                .iter()
                .zip(&partial)
                .map(|(&v, &p)| {
                    if qkvd {
                        (v + p as f64) as f32
                    } else {
                        v as f32
                    }
                })
                .collect();
            assert_close(
                &format!("{what}: raw"),
                &g.download(raw.ptr(), rows_a),
                &want_raw,
                1e-4,
            );
            assert_close(
                &format!("{what}: stream"),
                &g.download(after.ptr(), hidden),
                &want_after,
                4e-3,
            );
            assert_close(
                &format!("{what}: partial sums"),
                &g.download(parts.ptr(), hidden / FOLD_ROWS),
                &want_parts,
                1e-2,
            );
        }
    }
}

/// `fold_weights` against `a·diag(g)·b` (and `a·diag(g)` alone) in f64, written into a
/// column range of a wider matrix whose other columns it leaves alone.
#[test]
#[ignore = "needs a CUDA device"]
fn fold_weights_match_the_reference() {
    let g = gpu(64);
    let (rows, k, n) = (37, 96, 300);
    let stride = k + n + 5;
    let mut r = rng(95);
    let a = round_bf16(&uniform(&mut r, rows * k, 0.2));
    let norm = round_bf16(&uniform(&mut r, k, 1.5));
    let b = round_bf16(&uniform(&mut r, k * n, 0.2));
    let (a_d, norm_d, b_d) = (g.upload_bf16(&a), g.upload_bf16(&norm), g.upload_bf16(&b));
    let out = g.upload(&vec![bf16::from_f32(7.0); rows * stride]);
    g.kernels
        .fold_weights(
            a_d.ptr(),
            norm_d.ptr(),
            DPtr::NULL,
            out.ptr(),
            (rows, k, k),
            stride,
            0,
        )
        .unwrap();
    g.kernels
        .fold_weights(
            a_d.ptr(),
            norm_d.ptr(),
            b_d.ptr(),
            out.ptr(),
            (rows, k, n),
            stride,
            k,
        )
        .unwrap();
    let got = g.download_bf16(out.ptr(), rows * stride);
    let (mut scaled_got, mut scaled_want, mut product_got, mut product_want) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for o in 0..rows {
        let row = &got[o * stride..(o + 1) * stride];
        for j in 0..k {
            scaled_got.push(row[j]);
            scaled_want.push((a[o * k + j] as f64 * norm[j] as f64) as f32);
        }
        for j in 0..n {
            product_got.push(row[k + j]);
            let sum: f64 = (0..k)
                .map(|i| a[o * k + i] as f64 * norm[i] as f64 * b[i * n + j] as f64)
                .sum();
            product_want.push(sum as f32);
        }
        assert!(
            row[k + n..].iter().all(|&v| v == 7.0),
            "row {o}: columns past the product were written"
        );
    }
    assert_close("fold_weights a·diag(g)", &scaled_got, &scaled_want, 4e-3);
    assert_close(
        "fold_weights a·diag(g)·b",
        &product_got,
        &product_want,
        4e-3,
    );
}

fn reference_product(x: &[f32], w: &[f32], tokens: usize, inf: usize, outf: usize) -> Vec<f64> {
    (0..tokens * outf)
        .map(|i| {
            let (t, o) = (i / outf, i % outf);
            (0..inf)
                .map(|k| x[t * inf + k] as f64 * w[o * inf + k] as f64)
                .sum()
        })
        .collect()
}

/// The gated activation of a `[gate; up]` product (`outf` columns a token: gate rows 0..outf/2,
/// up rows after): silu(gate) · up from the bf16-rounded products, as the GLU gemv writes it.
fn reference_glu(product: &[f64], tokens: usize, outf: usize) -> Vec<f32> {
    let f = outf / 2;
    (0..tokens * f)
        .map(|i| {
            let (t, o) = (i / f, i % f);
            let gate = bf16::from_f64(product[t * outf + o]).to_f32();
            let up = bf16::from_f64(product[t * outf + f + o]).to_f32();
            gate / (1.0 + (-gate).exp()) * up
        })
        .collect()
}

/// RMSNorm of f32 rows with `weight`, rounded to bf16 as `add_rms_norm` writes it.
fn reference_norm(x: &[f32], weight: &[f32], hidden: usize, eps: f32) -> Vec<f32> {
    x.chunks(hidden)
        .flat_map(|row| {
            let mean = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / hidden as f64;
            let scale = (1.0 / (mean + eps as f64).sqrt()) as f32;
            row.iter()
                .zip(weight)
                .map(move |(&v, &g)| bf16::from_f32(v * scale * g).to_f32())
        })
        .collect()
}

#[test]
#[ignore = "needs a CUDA device"]
fn gemv_fuses_the_norm_before_and_the_activation_or_residual_add_after() {
    let g = gpu(64);
    let eps = 1e-5;
    for ((tokens, inf, outf), tc) in [(1, 576, 960), (3, 4096, 302), (8, 1536, 576), (2, 64, 8)]
        .into_iter()
        .flat_map(|shape| [(shape, false), (shape, true)])
    {
        let gemv = gemv(&g, tc);
        let mut r = rng(40 + tokens as u64);
        let residual = uniform(&mut r, tokens * inf, 2.0);
        let norm_weight = round_bf16(&uniform(&mut r, inf, 1.5));
        let w = round_bf16(&uniform(&mut r, outf * inf, 0.1));
        let x = round_bf16(&uniform(&mut r, tokens * inf, 1.0));
        let (residual_d, norm_d) = (g.upload(&residual), g.upload_bf16(&norm_weight));
        let (w_d, x_d) = (g.upload_bf16(&w), g.upload_bf16(&x));
        let normed = GemvInput::Normed {
            residual: residual_d.ptr(),
            weight: norm_d.ptr(),
            eps,
        };
        let shape = Linear {
            tokens,
            in_features: inf,
            out_features: outf,
        };
        let what = |mode: &str| format!("{mode} {tokens}x{inf} by {outf} (tensor cores: {tc})");

        let y = g.poisoned(tokens * outf * 2);
        gemv(normed, w_d.ptr(), GemvOutput::Rows(y.ptr()), shape).unwrap();
        let product = reference_product(
            &reference_norm(&residual, &norm_weight, inf, eps),
            &w,
            tokens,
            inf,
            outf,
        );
        let want: Vec<f32> = product.iter().map(|&v| v as f32).collect();
        let got = g.download_bf16(y.ptr(), tokens * outf);
        assert_close(&what("gemv_norm"), &got, &want, 4e-3);

        let f = outf / 2;
        let glu = |product: &[f64]| reference_glu(product, tokens, outf);
        let y = g.poisoned(tokens * f * 2);
        gemv(normed, w_d.ptr(), GemvOutput::Glu(y.ptr()), shape).unwrap();
        let got = g.download_bf16(y.ptr(), tokens * f);
        assert_close(&what("gemv_norm_glu"), &got, &glu(&product), 8e-3);

        let plain = reference_product(&x, &w, tokens, inf, outf);
        let y = g.poisoned(tokens * f * 2);
        gemv(
            GemvInput::Rows(x_d.ptr()),
            w_d.ptr(),
            GemvOutput::Glu(y.ptr()),
            shape,
        )
        .unwrap();
        let got = g.download_bf16(y.ptr(), tokens * f);
        assert_close(&what("gemv_glu"), &got, &glu(&plain), 8e-3);

        let stream = uniform(&mut r, tokens * outf, 3.0);
        let stream_d = g.upload(&stream);
        let out = GemvOutput::Accumulate(stream_d.ptr());
        gemv(GemvInput::Rows(x_d.ptr()), w_d.ptr(), out, shape).unwrap();
        let want: Vec<f32> = stream
            .iter()
            .zip(&plain)
            .map(|(&s, &p)| s + bf16::from_f64(p).to_f32())
            .collect();
        let got = g.download(stream_d.ptr::<f32>(), tokens * outf);
        assert_close(&what("gemv_accum"), &got, &want, 1e-3);
    }
}

/// The tensor-core gemv gives each token the bits it gets alone, at every token count and for
/// every fused mode: a verification's positions are computed as one-token steps compute them.
#[test]
#[ignore = "needs a CUDA device"]
fn gemv_tc_gives_a_token_the_same_bits_whatever_the_tokens_beside_it() {
    let g = gpu(64);
    let eps = 1e-5;
    for (inf, outf) in [(576, 960), (1536, 576), (4096, 1032)] {
        let mut r = rng(inf as u64 + outf as u64);
        let most = GEMV_MAX_TOKENS;
        let x = round_bf16(&uniform(&mut r, most * inf, 1.0));
        let w = round_bf16(&uniform(&mut r, outf * inf, 0.1));
        let residual = uniform(&mut r, most * inf, 2.0);
        let norm_weight = round_bf16(&uniform(&mut r, inf, 1.5));
        let stream = uniform(&mut r, most * outf, 3.0);
        let (x_d, w_d) = (g.upload_bf16(&x), g.upload_bf16(&w));
        let (residual_d, norm_d) = (g.upload(&residual), g.upload_bf16(&norm_weight));
        // (name, normed input, output kind, output elements a token, f32 output)
        let modes = [
            ("gemv", false, 0, outf),
            ("gemv_norm", true, 0, outf),
            ("gemv_glu", false, 1, outf / 2),
            ("gemv_norm_glu", true, 1, outf / 2),
            ("gemv_accum", false, 2, outf),
        ];
        for (name, normed, kind, per_token) in modes {
            // Each token's output bits from a launch of `tokens` tokens from token `first` on.
            let run = |first: usize, tokens: usize| -> Vec<Vec<u32>> {
                let input = if normed {
                    GemvInput::Normed {
                        residual: residual_d.ptr::<f32>().offset(first * inf),
                        weight: norm_d.ptr(),
                        eps,
                    }
                } else {
                    GemvInput::Rows(x_d.ptr::<bf16>().offset(first * inf))
                };
                let y = if kind == 2 {
                    g.upload(&stream[first * per_token..(first + tokens) * per_token])
                } else {
                    g.poisoned(tokens * per_token * 2)
                };
                let output = match kind {
                    0 => GemvOutput::Rows(y.ptr()),
                    1 => GemvOutput::Glu(y.ptr()),
                    _ => GemvOutput::Accumulate(y.ptr()),
                };
                let shape = Linear {
                    tokens,
                    in_features: inf,
                    out_features: outf,
                };
                g.kernels.gemv_tc(input, w_d.ptr(), output, shape).unwrap();
                let bits: Vec<u32> = if kind == 2 {
                    let v: Vec<f32> = g.download(y.ptr(), tokens * per_token);
                    v.iter().map(|v| v.to_bits()).collect()
                } else {
                    let v: Vec<bf16> = g.download(y.ptr(), tokens * per_token);
                    v.iter().map(|v| v.to_bits() as u32).collect()
                };
                bits.chunks(per_token).map(<[u32]>::to_vec).collect()
            };
            let alone: Vec<Vec<u32>> = (0..most).map(|t| run(t, 1).remove(0)).collect();
            for tokens in 2..=most {
                for (t, got) in run(0, tokens).iter().enumerate() {
                    let differ = got.iter().zip(&alone[t]).filter(|(a, b)| a != b).count();
                    assert_eq!(
                        differ, 0,
                        "{name} {inf}->{outf}: token {t} of {tokens} differs from the token \
                         alone in {differ} of {per_token} outputs"
                    );
                }
            }
        }
    }
}

/// A pool with random K and V in layer 0, its host copy, and rows with scattered pages.
struct AttentionCase {
    shape: AttnShape,
    pool: KvPool,
    k: Vec<f32>,
    v: Vec<f32>,
    plan: StepPlan,
}

fn attention_case(g: &Gpu, shape: AttnShape, rows: &[(usize, usize)], seed: u64) -> AttentionCase {
    let mut r = rng(seed);
    let pages_needed: usize = rows
        .iter()
        .map(|&(start, n)| (start + n).div_ceil(shape.page_tokens))
        .sum();
    let pages = pages_needed + 3;
    let geometry = KvGeometry {
        layers: 1,
        kv_heads: shape.kv_heads,
        head_dim: shape.head_dim,
        page_tokens: shape.page_tokens,
        dtype_bytes: 2,
    };
    let pool = KvPool::new(&g.device, geometry, pages).unwrap();
    let elems = pool.pages_total() * pool.page_elems();
    let (k, v) = (
        round_bf16(&uniform(&mut r, elems, 2.0)),
        round_bf16(&uniform(&mut r, elems, 1.0)),
    );
    let to_bits = |x: &[f32]| x.iter().map(|&f| bf16::from_f32(f)).collect::<Vec<_>>();
    g.device.upload(&to_bits(&k), pool.cache(0, false)).unwrap();
    g.device.upload(&to_bits(&v), pool.cache(0, true)).unwrap();
    // Pages handed out in a shuffled order, so no row's pages are consecutive.
    let mut order: Vec<u32> = (0..pages as u32).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, r.random_range(0..=i));
    }
    let mut next = order.into_iter();
    let plan = StepPlan {
        rows: rows
            .iter()
            .map(|&(start_pos, n)| RowPlan {
                tokens: vec![1; n],
                start_pos,
                pages: (0..(start_pos + n).div_ceil(shape.page_tokens))
                    .map(|_| PageId(next.next().unwrap()))
                    .collect(),
                logits: LogitsWanted::Last,
            })
            .collect(),
    };
    AttentionCase {
        shape,
        pool,
        k,
        v,
        plan,
    }
}

impl AttentionCase {
    /// Reference output `[tokens, heads · head_dim]` for queries `q` (`[tokens, qkv width]`).
    fn reference(&self, q: &[f32]) -> Vec<f32> {
        let s = self.shape;
        let (d, group) = (s.head_dim, s.heads / s.kv_heads);
        let mut out = Vec::new();
        let mut token = 0;
        for row in &self.plan.rows {
            for j in 0..row.tokens.len() {
                let pos = row.start_pos + j;
                let lo = if s.window > 0 {
                    (pos + 1).saturating_sub(s.window)
                } else {
                    0
                };
                for h in 0..s.heads {
                    let qh = &q[token * s.qkv_width() + h * d..][..d];
                    let at = |p: usize| {
                        let slot = row.pages[p / s.page_tokens].index() * s.page_tokens
                            + p % s.page_tokens;
                        (slot * s.kv_heads + h / group) * d
                    };
                    let scores: Vec<f64> = (lo..=pos)
                        .map(|p| {
                            let k = &self.k[at(p)..at(p) + d];
                            qh.iter()
                                .zip(k)
                                .map(|(a, b)| *a as f64 * *b as f64)
                                .sum::<f64>()
                                / (d as f64).sqrt()
                        })
                        .collect();
                    let max = scores.iter().cloned().fold(f64::MIN, f64::max);
                    let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                    let total: f64 = weights.iter().sum();
                    for i in 0..d {
                        let o: f64 = (lo..=pos)
                            .zip(&weights)
                            .map(|(p, w)| w * self.v[at(p) + i] as f64)
                            .sum();
                        out.push((o / total) as f32);
                    }
                }
                token += 1;
            }
        }
        out
    }

    /// Loads the plan's metadata, random queries, and a poisoned output.
    fn inputs(
        &self,
        g: &Gpu,
        meta: &mut StepMeta,
        seed: u64,
    ) -> (Vec<f32>, DeviceBuffer, DeviceBuffer, usize) {
        let s = self.shape;
        let item_tokens = if self.plan.rows.iter().all(|r| r.tokens.len() == 1) {
            0
        } else {
            s.prefill_tile_tokens()
        };
        let layout = meta
            .load(
                &g.kernels,
                &PackRequest {
                    plan: &self.plan,
                    select: LogitSelection::Wanted,
                    pad_rows_to: 0,
                    item_tokens,
                    decode_rows_apart: false,
                    sample_params: &[],
                    picks_slot: 0,
                },
            )
            .unwrap();
        let tokens = self.plan.total_tokens();
        let q = round_bf16(&uniform(&mut rng(seed), tokens * s.qkv_width(), 2.0));
        let out = g.poisoned(tokens * s.heads * s.head_dim * 2);
        (q.clone(), g.upload_bf16(&q), out, layout.items)
    }

    fn attention(&self, qkv: DPtr<bf16>, meta: &StepMeta, out: DPtr<bf16>) -> Attention {
        Attention {
            qkv,
            k_cache: self.pool.cache(0, false),
            v_cache: self.pool.cache(0, true),
            rows: meta.buffers().rows,
            shape: self.shape,
            out,
        }
    }
}

/// Pages a row's table holds in these tests: rows of up to 16,384 positions.
const TABLE_STRIDE: usize = 1024;

fn meta_for(g: &Gpu, page_tokens: usize, spare: PageId) -> StepMeta {
    let capacity = MetaCapacity {
        tokens: 2048,
        rows: 64,
        table_stride: TABLE_STRIDE,
    };
    StepMeta::new(&g.device, capacity, page_tokens, spare).unwrap()
}

fn shape(heads: usize, kv_heads: usize, head_dim: usize, window: usize) -> AttnShape {
    AttnShape {
        heads,
        kv_heads,
        head_dim,
        page_tokens: 16,
        window,
    }
}

/// Rotates one head by `pos` (pairs i, i + d/2), as Hugging Face does.
fn rotate(head: &[f64], pos: usize, inv_freq: &[f32]) -> Vec<f64> {
    let half = head.len() / 2;
    let mut out = head.to_vec();
    for i in 0..half {
        let angle = (pos as f32 * inv_freq[i]) as f64;
        out[i] = head[i] * angle.cos() - head[i + half] * angle.sin();
        out[i + half] = head[i + half] * angle.cos() + head[i] * angle.sin();
    }
    out
}

/// Rotated queries of `raw` q/k/v rows (bias added), and with `store` the new k/v written into
/// the host copy of the cache as the kernel must store them; returns the queries and the
/// written offsets.
fn decode_reference_inputs(
    case: &mut AttentionCase,
    raw: &[f32],
    bias: &[f32],
    inv_freq: &[f32],
    store: bool,
) -> (Vec<f32>, Vec<usize>) {
    let s = case.shape;
    let (d, width) = (s.head_dim, s.qkv_width());
    let mut q = vec![0f32; raw.len()];
    let mut appended = Vec::new();
    for (t, row) in case.plan.rows.iter().enumerate() {
        let pos = row.start_pos;
        let x: Vec<f64> = (0..width)
            .map(|i| (raw[t * width + i] + bias[i]) as f64)
            .collect();
        for h in 0..s.heads {
            let r = rotate(&x[h * d..(h + 1) * d], pos, inv_freq);
            for (o, v) in q[t * width + h * d..][..d].iter_mut().zip(r) {
                *o = v as f32;
            }
        }
        if !store {
            continue;
        }
        let slot = row.pages[pos / s.page_tokens].index() * s.page_tokens + pos % s.page_tokens;
        for h in 0..s.kv_heads {
            let k = rotate(&x[(s.heads + h) * d..][..d], pos, inv_freq);
            let v = &x[(s.heads + s.kv_heads + h) * d..][..d];
            let at = (slot * s.kv_heads + h) * d;
            for i in 0..d {
                case.k[at + i] = bf16::from_f64(k[i]).to_f32();
                case.v[at + i] = bf16::from_f64(v[i]).to_f32();
            }
            appended.push(at);
        }
    }
    (q, appended)
}

/// Decode attention of rows holding `contexts` positions, the last one new (its q/k/v raw from
/// the projection), run twice to show the split counters reset.
fn check_decode(shape: AttnShape, contexts: &[usize], splits: usize, with_bias: bool) {
    let g = gpu(shape.head_dim);
    let rows: Vec<(usize, usize)> = contexts.iter().map(|&c| (c - 1, 1)).collect();
    let mut case = attention_case(&g, shape, &rows, 6 + splits as u64);
    let (d, width) = (shape.head_dim, shape.qkv_width());
    let mut meta = meta_for(&g, shape.page_tokens, case.pool.spare_page());
    let (raw, raw_d, out, _) = case.inputs(&g, &mut meta, 7);
    let bias = if with_bias {
        round_bf16(&uniform(&mut rng(8), width, 0.5))
    } else {
        vec![0.0; width]
    };
    let inv_freq: Vec<f32> = (0..d / 2)
        .map(|i| 1.0 / 10000f32.powf(2.0 * i as f32 / d as f32))
        .collect();
    let (bias_d, freq_d) = (g.upload_bf16(&bias), g.upload(&inv_freq));
    let (q, appended) = decode_reference_inputs(&mut case, &raw, &bias, &inv_freq, true);
    let want = case.reference(&q);
    let n = rows.len() * shape.heads;
    let (o_part, lse) = (g.poisoned(n * splits * d * 4), g.poisoned(n * splits * 4));
    let done = g.upload(&vec![0u32; rows.len() * shape.decode_blocks_per_row()]);
    let split = Splits {
        splits,
        o_part: o_part.ptr(),
        lse_part: lse.ptr(),
        done: done.ptr(),
    };
    let attention = DecodeAttention {
        qkv: raw_d.ptr(),
        bias: if with_bias { bias_d.ptr() } else { DPtr::NULL },
        inv_freq: freq_d.ptr(),
        k_cache: case.pool.cache(0, false),
        v_cache: case.pool.cache(0, true),
        rows: meta.buffers().rows,
        shape,
        out: out.ptr(),
        store_kv: true,
        row_items: DPtr::NULL,
        folded: None,
    };
    let what = format!("decode {shape:?} contexts {contexts:?} splits {splits} bias {with_bias}");
    for run in 0..2 {
        if splits == RESIDENT {
            g.kernels
                .decode_attention_resident(&attention, rows.len())
                .unwrap();
        } else {
            g.kernels
                .decode_attention(&attention, rows.len(), &split)
                .unwrap();
        }
        let got = g.download_bf16(out.ptr(), n * d);
        assert_close(&format!("{what}, run {run}"), &got, &want, 1e-2);
    }
    let elems = case.pool.pages_total() * case.pool.page_elems();
    let k_all = g.download_bf16(case.pool.cache(0, false), elems);
    let v_all = g.download_bf16(case.pool.cache(0, true), elems);
    let pick = |all: &[f32]| -> Vec<f32> {
        appended
            .iter()
            .flat_map(|&at| all[at..at + d].to_vec())
            .collect()
    };
    assert_close("appended k", &pick(&k_all), &pick(&case.k), 8e-3);
    assert_close("appended v", &pick(&v_all), &pick(&case.v), 8e-3);
}

#[test]
#[ignore = "needs a CUDA device"]
fn decode_attention_matches_reference() {
    check_decode(shape(9, 3, 64, 0), &[1, 17, 300], 1, false);
    check_decode(shape(9, 3, 64, 0), &[1, 17, 300, 1000], 7, true);
    check_decode(shape(32, 8, 128, 0), &[5, 513, 64], 4, false);
    check_decode(shape(14, 2, 64, 0), &[40, 200], 3, true);
    check_decode(shape(4, 2, 16, 0), &[3, 90], 2, false);
    check_decode(shape(8, 8, 32, 100), &[30, 333], 5, false);
    // As many splits as a launch may have, over a long row and a short one.
    check_decode(shape(32, 8, 128, 0), &[9000, 70], MAX_SPLITS, false);
}

#[test]
#[ignore = "needs a CUDA device"]
fn decode_attention_merges_short_rows_in_a_cluster() {
    // Heads of up to 64 with splits a multiple of CLUSTER_SPLITS launch in clusters: rows of
    // at most 8 · 256 positions take a tile a split and merge in shared memory, longer ones
    // split as before; a context of one and two positions, tile and page edges.
    let contexts = [1, 2, 64, 65, 100, 512, 2048, 2049, 3000];
    check_decode(shape(9, 3, 64, 0), &contexts, 88, true);
    check_decode(shape(16, 4, 64, 0), &[1, 63, 64, 200, 513, 1500], 32, false);
    check_decode(shape(14, 2, 64, 0), &[40, 129, 1000], 8, true);
    check_decode(shape(4, 2, 16, 0), &[3, 90, 700], 16, false);
    // A sliding window of 100: every row's splits start past position 0.
    check_decode(shape(8, 8, 32, 100), &[30, 101, 333], 8, false);
}

#[test]
#[ignore = "needs a CUDA device"]
fn resident_decode_attention_matches_reference() {
    // One block a row and head group, the row's context in shared memory: contexts of one and
    // two positions, tile and page edges, the longest the launch holds; groups of 3, 4 and 7
    // (two blocks a KV head), heads of 16 to 128, a window, bias.
    for (s, bias) in [
        (shape(9, 3, 64, 0), true),
        (shape(16, 4, 64, 0), false),
        (shape(14, 2, 64, 0), true),
        (shape(32, 8, 128, 0), false),
        (shape(4, 2, 16, 0), false),
        (shape(8, 8, 32, 100), false),
    ] {
        let most = gpu(s.head_dim).kernels.resident_positions();
        assert!(most >= 256, "{s:?}: the launch holds {most} positions");
        let contexts = [1, 2, 63, 64, 65, 100, 257, most - 1, most];
        check_decode(s, &contexts, RESIDENT, bias);
    }
}

/// Decode attention of verifications, given as (first position, width), each run as rows of
/// one position over its sequence's pages, their keys and values in the cache already (a
/// verification's launch, `store_kv` off): each position must come out as the reference says
/// and with the bits it has when it is the launch's only row, which is what lets speculation
/// give the text of one token a step.
fn check_verification_rows(shape: AttnShape, verifications: &[(usize, usize)], splits: usize) {
    let g = gpu(shape.head_dim);
    let mut case = attention_case(&g, shape, verifications, 30 + splits as u64);
    case.plan = StepPlan {
        rows: case
            .plan
            .rows
            .iter()
            .flat_map(|row| {
                (0..row.tokens.len()).map(|k| RowPlan {
                    tokens: vec![1],
                    start_pos: row.start_pos + k,
                    pages: row.pages.clone(),
                    logits: LogitsWanted::Last,
                })
            })
            .collect(),
    };
    let rows = case.plan.rows.len();
    let (d, width) = (shape.head_dim, shape.qkv_width());
    let mut meta = meta_for(&g, shape.page_tokens, case.pool.spare_page());
    let (raw, raw_d, out, _) = case.inputs(&g, &mut meta, 31);
    let bias = round_bf16(&uniform(&mut rng(32), width, 0.5));
    let inv_freq: Vec<f32> = (0..d / 2)
        .map(|i| 1.0 / 10000f32.powf(2.0 * i as f32 / d as f32))
        .collect();
    let (bias_d, freq_d) = (g.upload_bf16(&bias), g.upload(&inv_freq));
    let (q, _) = decode_reference_inputs(&mut case, &raw, &bias, &inv_freq, false);
    let want = case.reference(&q);
    let n = rows * shape.heads;
    let (o_part, lse) = (g.poisoned(n * splits * d * 4), g.poisoned(n * splits * 4));
    let done = g.upload(&vec![0u32; rows * shape.decode_blocks_per_row()]);
    let split = Splits {
        splits,
        o_part: o_part.ptr(),
        lse_part: lse.ptr(),
        done: done.ptr(),
    };
    let attention = |qkv: DPtr<bf16>, meta: &StepMeta, out: DPtr<bf16>| DecodeAttention {
        qkv,
        bias: bias_d.ptr(),
        inv_freq: freq_d.ptr(),
        k_cache: case.pool.cache(0, false),
        v_cache: case.pool.cache(0, true),
        rows: meta.buffers().rows,
        shape,
        out,
        store_kv: false,
        row_items: DPtr::NULL,
        folded: None,
    };
    let what = format!("verification rows {shape:?} {verifications:?} splits {splits}");
    let together = attention(raw_d.ptr(), &meta, out.ptr());
    let mut got = Vec::new();
    for run in 0..2 {
        g.kernels.decode_attention(&together, rows, &split).unwrap();
        got = g.download_bf16(out.ptr(), n * d);
        assert_close(&format!("{what}, run {run}"), &got, &want, 1e-2);
    }
    // Each position alone: its own q/k/v row, the only row of its launch.
    let per_row = shape.heads * d;
    for (r, row) in case.plan.rows.iter().enumerate() {
        let alone = StepPlan {
            rows: vec![row.clone()],
        };
        meta.load(
            &g.kernels,
            &PackRequest {
                plan: &alone,
                select: LogitSelection::Wanted,
                pad_rows_to: 0,
                item_tokens: 0,
                decode_rows_apart: false,
                sample_params: &[],
                picks_slot: 0,
            },
        )
        .unwrap();
        let qkv = g.upload_bf16(&raw[r * width..(r + 1) * width]);
        let out_alone = g.poisoned(per_row * 2);
        g.kernels
            .decode_attention(&attention(qkv.ptr(), &meta, out_alone.ptr()), 1, &split)
            .unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&g.download_bf16(out_alone.ptr(), per_row)),
            bits(&got[r * per_row..(r + 1) * per_row]),
            "{what}: position {} alone",
            row.start_pos
        );
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn decode_attention_gives_a_verifications_positions_their_bits_alone() {
    // The 8B shape: page boundaries inside, a split length changing inside (position 520 is
    // the first of 66 positions a split).
    check_verification_rows(shape(32, 8, 128, 0), &[(512, 8), (516, 8), (14, 8)], 33);
    check_verification_rows(shape(32, 8, 128, 0), &[(100, 3), (7000, 6), (9, 1)], 33);
    // SmolLM2's three heads a group; a context of one token; more heads than a block holds.
    check_verification_rows(shape(9, 3, 64, 0), &[(0, 8), (40, 8), (300, 7)], 7);
    check_verification_rows(shape(16, 2, 64, 0), &[(70, 8), (255, 5)], 5);
    // A sliding window: every position starts its splits elsewhere.
    check_verification_rows(shape(8, 8, 32, 100), &[(150, 8), (20, 4)], 5);
    check_verification_rows(shape(4, 2, 16, 0), &[(63, 8)], 1);
    // Launched in clusters (splits a multiple of CLUSTER_SPLITS), as batch 1 of SmolLM2 is on
    // an H200.
    check_verification_rows(shape(9, 3, 64, 0), &[(0, 8), (60, 8), (505, 7)], 88);
    check_verification_rows(shape(16, 4, 64, 0), &[(512, 8), (2040, 8), (14, 8)], 32);
    check_verification_rows(shape(8, 8, 32, 100), &[(150, 8), (20, 4)], 8);
}

/// Prefill attention of rows of (start position, new tokens), its keys split over `splits`
/// blocks per work item.
fn check_prefill(shape: AttnShape, rows: &[(usize, usize)], splits: usize) {
    let g = gpu(shape.head_dim);
    let case = attention_case(&g, shape, rows, 8);
    let mut meta = meta_for(&g, shape.page_tokens, case.pool.spare_page());
    let (q, q_d, out, items) = case.inputs(&g, &mut meta, 9);
    let tokens = case.plan.total_tokens();
    let parts = tokens * shape.heads * splits;
    let (o_part, lse) = (
        g.poisoned(parts * shape.head_dim * 4),
        g.poisoned(parts * 4),
    );
    let split = Splits {
        splits,
        o_part: o_part.ptr(),
        lse_part: lse.ptr(),
        done: DPtr::NULL,
    };
    g.kernels
        .prefill_attention(
            &case.attention(q_d.ptr(), &meta, out.ptr()),
            items,
            tokens,
            &split,
        )
        .unwrap();
    let got = g.download_bf16(out.ptr(), tokens * shape.heads * shape.head_dim);
    let what = format!("prefill {shape:?} rows {rows:?} splits {splits}");
    assert_close(&what, &got, &case.reference(&q), 2e-2);
}

#[test]
#[ignore = "needs a CUDA device"]
fn prefill_attention_matches_reference() {
    // (start position, tokens): fresh prompts, a restored prefix plus new tokens, one token.
    check_prefill(shape(9, 3, 64, 0), &[(0, 100), (48, 37), (5, 1)], 1);
    check_prefill(shape(32, 8, 128, 0), &[(0, 130), (200, 70)], 1);
    check_prefill(shape(14, 2, 64, 0), &[(0, 50), (16, 20)], 1);
    check_prefill(shape(16, 1, 32, 0), &[(0, 40)], 1);
    check_prefill(shape(4, 2, 16, 0), &[(0, 33), (7, 9)], 1);
    check_prefill(shape(8, 4, 64, 24), &[(0, 90), (60, 40)], 1);
}

#[test]
#[ignore = "needs a CUDA device"]
fn prefill_attention_split_over_keys_matches_reference() {
    // A few new tokens over a long restored context, split more ways than some items have
    // tiles (those splits are empty), beside a fresh prompt; and a sliding window.
    check_prefill(shape(32, 8, 128, 0), &[(3000, 32), (0, 20)], 7);
    check_prefill(shape(9, 3, 64, 0), &[(1500, 5), (700, 70)], 16);
    check_prefill(shape(16, 1, 32, 0), &[(900, 3)], 3);
    check_prefill(shape(8, 4, 64, 200), &[(1000, 40)], 4);
}

/// The sampling kernel's rule, written plainly: rank, cut, weigh, draw in id order.
fn reference_sample(logits: &[f32], p: &[u32; SAMPLE_PARAM_WORDS]) -> u32 {
    let (temperature, top_k, top_p, min_p) = (
        f32::from_bits(p[0]),
        p[1] as usize,
        f32::from_bits(p[2]),
        f32::from_bits(p[3]),
    );
    let uniform = f64::from_bits(p[4] as u64 | (p[5] as u64) << 32);
    let best = crate::sampling::argmax(logits);
    if temperature == 0.0 || !logits.iter().any(|l| *l > f32::NEG_INFINITY) {
        return best;
    }
    let rank =
        |a: &(usize, f32), b: &(usize, f32)| b.1.partial_cmp(&a.1).unwrap().then(a.0.cmp(&b.0));
    let mut kept: Vec<(usize, f32)> = logits
        .iter()
        .enumerate()
        .filter(|(_, l)| **l > f32::NEG_INFINITY)
        .map(|(i, l)| (i, l.min(f32::MAX)))
        .collect();
    kept.sort_by(rank);
    if top_k > 0 && top_k < kept.len() {
        kept.truncate(top_k);
    }
    let max = kept[0].1;
    let mut weights: Vec<(usize, f32)> = kept
        .iter()
        .map(|&(i, l)| (i, ((l - max) / temperature).exp()))
        .collect();
    if top_p < 1.0 {
        weights.sort_by(rank);
        let target = top_p as f64 * weights.iter().map(|w| w.1 as f64).sum::<f64>();
        let mut mass = 0.0;
        let len = weights.iter().position(|w| {
            mass += w.1 as f64;
            mass >= target
        });
        weights.truncate(len.map_or(weights.len(), |l| l + 1));
    }
    weights.retain(|w| w.1 > 0.0 && w.1 >= min_p);
    weights.sort_by_key(|w| w.0);
    let threshold = uniform * weights.iter().map(|w| w.1 as f64).sum::<f64>();
    let mut mass = 0.0;
    for w in &weights {
        mass += w.1 as f64;
        if mass > threshold {
            return w.0 as u32;
        }
    }
    weights.last().unwrap().0 as u32
}

fn params(
    temperature: f32,
    top_k: u32,
    top_p: f32,
    min_p: f32,
    uniform: f64,
) -> [u32; SAMPLE_PARAM_WORDS] {
    let bits = uniform.to_bits();
    [
        temperature.to_bits(),
        top_k,
        top_p.to_bits(),
        min_p.to_bits(),
        bits as u32,
        (bits >> 32) as u32,
    ]
}

#[test]
#[ignore = "needs a CUDA device"]
fn sampling_matches_the_reference_rule() {
    let g = gpu(64);
    let vocab = 49_152;
    let mut r = rng(10);
    let rows = [
        params(0.0, 0, 1.0, 0.0, 0.0),
        params(0.0, 0, 1.0, 0.0, 0.0),
        params(1.0, 0, 1.0, 0.0, 0.37),
        params(0.7, 50, 1.0, 0.0, 0.91),
        params(1.0, 0, 0.9, 0.0, 0.55),
        params(1.3, 40, 0.8, 0.05, 0.02),
        params(0.5, 1, 1.0, 0.0, 0.99),
        params(2.0, 0, 0.95, 0.0, 0.999),
    ];
    let mut logits = uniform(&mut r, rows.len() * vocab, 8.0);
    // Row 1: ties at the top go to the lowest id, NaN and +inf handling on the greedy path.
    logits[vocab + 5] = 20.0;
    logits[vocab + 9] = 20.0;
    logits[vocab + 3] = f32::NAN;
    // Row 3 holds -inf logits that can never be drawn.
    logits[3 * vocab..3 * vocab + 100].fill(f32::NEG_INFINITY);
    let flat: Vec<u32> = rows.iter().flatten().copied().collect();
    let (logits_d, params_d) = (g.upload(&logits), g.upload(&flat));
    let (tokens, fed) = (g.poisoned(rows.len() * 4), g.poisoned(rows.len() * 4));
    g.kernels
        .sample_rows(
            logits_d.ptr(),
            vocab,
            params_d.ptr(),
            Picks {
                host: tokens.ptr(),
                fed: fed.ptr(),
                slot: DPtr::NULL,
                stride: 0,
            },
            DPtr::NULL,
            rows.len(),
        )
        .unwrap();
    let got = g.download(tokens.ptr::<u32>(), rows.len());
    // The device's own copy, which a step launched ahead reads its tokens from.
    assert_eq!(g.download(fed.ptr::<u32>(), rows.len()), got);
    let want: Vec<u32> = rows
        .iter()
        .enumerate()
        .map(|(i, p)| reference_sample(&logits[i * vocab..(i + 1) * vocab], p))
        .collect();
    assert_eq!(got, want);
    assert_eq!(got[1], 5);
}

#[test]
#[ignore = "needs a CUDA device"]
fn page_copies_round_trip_through_both_tiers() {
    let g = gpu(64);
    let geometry = KvGeometry {
        layers: 3,
        kv_heads: 2,
        head_dim: 64,
        page_tokens: 16,
        dtype_bytes: 2,
    };
    let pool = KvPool::new(&g.device, geometry, 10).unwrap();
    let bytes = pool.bytes() as usize;
    let mut r = rng(11);
    let data: Vec<u8> = (0..bytes)
        .map(|_| r.random_range(0..=255u32) as u8)
        .collect();
    g.device.upload(&data, pool.base()).unwrap();
    let copies = [(0u32, 7u32), (1, 2), (2, 9)];
    let list: Vec<u32> = copies.iter().flat_map(|&(s, p)| [s, p]).collect();
    let list_d = g.upload(&list);
    let page_bytes = pool.page_elems() * 2;
    let snapshot_bytes = copies.len() * geometry.page_bytes();
    let device_tier = g.poisoned(snapshot_bytes);
    let mut host_tier = PinnedBuffer::alloc(&g.device, snapshot_bytes, "test").unwrap();
    host_tier.as_mut_slice::<u8>().fill(0xFF);
    let blocks = copies.len() * 2 * geometry.layers;
    let sums = [g.poisoned(blocks * 8), g.poisoned(blocks * 8)];
    let bad = g.upload(&[0u32]);
    for (snapshot, sums) in [device_tier.ptr(), host_tier.ptr()].into_iter().zip(&sums) {
        let args = PageCopies {
            pool: pool.base(),
            snapshot,
            copies: list_d.ptr(),
            count: copies.len(),
            pages_total: pool.pages_total(),
            page_bytes,
            layers: geometry.layers,
            sums: sums.ptr(),
            bad: DPtr::NULL,
        };
        g.kernels.copy_pages(&args, true).unwrap();
    }
    let mut want = Vec::new();
    for &(_, p) in &copies {
        for block in 0..2 * geometry.layers {
            let at = (block * pool.pages_total() + p as usize) * page_bytes;
            want.extend_from_slice(&data[at..at + page_bytes]);
        }
    }
    assert_eq!(g.download(device_tier.ptr::<u8>(), snapshot_bytes), want);
    g.device.synchronize().unwrap();
    assert_eq!(host_tier.as_mut_slice::<u8>(), &want[..]);
    // The gathers summed every block as the CPU does.
    let want_sums = cache::checksum::block_sums(&want, page_bytes);
    for sums in &sums {
        assert_eq!(g.download(sums.ptr::<u64>(), blocks), want_sums);
    }
    // Scatter the host copy into other pages, then overwrite nothing else.
    let back: Vec<u32> = [(0u32, 1u32), (1, 4), (2, 0)]
        .iter()
        .flat_map(|&(s, p)| [s, p])
        .collect();
    let back_d = g.upload(&back);
    let args = PageCopies {
        pool: pool.base(),
        snapshot: host_tier.ptr(),
        copies: back_d.ptr(),
        count: 3,
        pages_total: pool.pages_total(),
        page_bytes,
        layers: geometry.layers,
        sums: sums[1].ptr(),
        bad: bad.ptr(),
    };
    g.kernels.copy_pages(&args, false).unwrap();
    assert_eq!(g.download(bad.ptr::<u32>(), 1), [0], "intact blocks pass");
    let after = g.download(pool.base(), bytes);
    for (i, &(_, src)) in copies.iter().enumerate() {
        let dst = [1usize, 4, 0][i];
        for block in 0..2 * geometry.layers {
            let (a, b) = (
                (block * pool.pages_total() + dst) * page_bytes,
                (block * pool.pages_total() + src as usize) * page_bytes,
            );
            assert_eq!(after[a..a + page_bytes], data[b..b + page_bytes]);
        }
    }
    // One flipped bit in the host tier's last block is caught by the scatter that reads it.
    g.device.synchronize().unwrap();
    let last = snapshot_bytes - 3;
    host_tier.as_mut_slice::<u8>()[last] ^= 0x10;
    g.kernels.copy_pages(&args, false).unwrap();
    assert_eq!(
        g.download(bad.ptr::<u32>(), 1),
        [1],
        "a flipped bit is refused"
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn step_metadata_lands_in_its_typed_buffers() {
    let g = gpu(64);
    let mut meta = meta_for(&g, 16, PageId(99));
    let plan = StepPlan {
        rows: vec![
            RowPlan {
                tokens: vec![5, 6, 7],
                start_pos: 30,
                pages: vec![PageId(4), PageId(8), PageId(1)],
                logits: LogitsWanted::All,
            },
            RowPlan {
                tokens: vec![9],
                start_pos: 0,
                pages: vec![PageId(3), PageId(2)],
                logits: LogitsWanted::Last,
            },
        ],
    };
    let sample = params(0.5, 3, 0.9, 0.0, 0.25);
    let layout = meta
        .load(
            &g.kernels,
            &PackRequest {
                plan: &plan,
                select: LogitSelection::Wanted,
                pad_rows_to: 4,
                item_tokens: 2,
                decode_rows_apart: false,
                sample_params: &sample,
                picks_slot: 1,
            },
        )
        .unwrap();
    assert_eq!(
        (layout.tokens, layout.rows, layout.items, layout.logit_rows),
        (6, 4, 5, 4)
    );
    let b = *meta.buffers();
    assert_eq!(g.download(b.token_ids, 6), [5, 6, 7, 9, 0, 0]);
    assert_eq!(g.download(b.positions, 6), [30, 31, 32, 0, 0, 0]);
    assert_eq!(
        g.download(b.slots, 6),
        [8 * 16 + 14, 8 * 16 + 15, 16, 3 * 16, 99 * 16, 99 * 16]
    );
    assert_eq!(g.download(b.logit_rows, 6), [0, 1, 2, 3, NO_ROW, NO_ROW]);
    assert_eq!(g.download(b.rows.start_token, 4), [0, 3, 4, 5]);
    assert_eq!(g.download(b.rows.start_pos, 4), [30, 0, 0, 0]);
    assert_eq!(g.download(b.rows.len, 4), [3, 1, 1, 1]);
    let table = g.download(b.rows.page_table, 4 * TABLE_STRIDE);
    assert_eq!(
        (&table[..3], table[TABLE_STRIDE], table[2 * TABLE_STRIDE]),
        (&[4, 8, 1][..], 3, 99)
    );
    // The item attending the most positions first (row 0 from position 32, then 30).
    assert_eq!(g.download(b.rows.items, 10), [0, 2, 0, 0, 1, 0, 2, 0, 3, 0]);
    assert_eq!(g.download(b.sample_params, 6), sample);
    assert_eq!(g.download(b.picks_slot, 1), [1]);
    // A step launched ahead of the picks it follows: its tokens are read from the picks the
    // sampling kernel left on the device, by row; ids below FED_TOKEN are kept as they are.
    g.device.upload(&[41u32, 42, 43], b.fed_tokens).unwrap();
    let decode = StepPlan {
        rows: [FED_TOKEN + 2, 7, FED_TOKEN]
            .into_iter()
            .map(|token| RowPlan {
                tokens: vec![token],
                start_pos: 3,
                pages: vec![PageId(5)],
                logits: LogitsWanted::Last,
            })
            .collect(),
    };
    meta.load(
        &g.kernels,
        &PackRequest {
            plan: &decode,
            select: LogitSelection::LastOfEachRow,
            pad_rows_to: 4,
            item_tokens: 0,
            decode_rows_apart: false,
            sample_params: &[],
            picks_slot: 0,
        },
    )
    .unwrap();
    assert_eq!(g.download(b.token_ids, 4), [43, 7, 41, 0]);
}

#[test]
#[ignore = "needs a CUDA device"]
fn random_weights_are_a_pure_function_of_the_seed() {
    let g = gpu(64);
    let n = 100_003;
    let out = g.poisoned(n * 2);
    g.kernels
        .fill_uniform(out.ptr(), n, 42, (-0.5, 0.25))
        .unwrap();
    let got = g.download_bf16(out.ptr(), n);
    let splitmix = |mut x: u64| {
        x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        x ^ (x >> 31)
    };
    let want: Vec<f32> = (0..n as u64)
        .map(|i| {
            let u = (splitmix(42 ^ splitmix(i)) >> 40) as f32 / 16_777_216.0;
            bf16::from_f32(-0.5 + 0.75 * u).to_f32()
        })
        .collect();
    let off = got
        .iter()
        .zip(&want)
        .filter(|(a, b)| (*a - *b).abs() > 2f32.powi(-8))
        .count();
    assert_eq!(off, 0, "every value within one bf16 step of the reference");
    assert!(got.iter().all(|v| (-0.5..=0.25).contains(v)));
}

#[test]
#[ignore = "needs a CUDA device"]
fn sampling_picks_only_what_the_mask_allows() {
    let g = gpu(64);
    let vocab: usize = 49_152 + 7; // a last word only partly used
    let words = vocab.div_ceil(32);
    let mut r = rng(11);
    let rows = [
        params(0.0, 0, 1.0, 0.0, 0.0),
        params(1.0, 0, 1.0, 0.0, 0.37),
        params(0.8, 40, 0.9, 0.0, 0.73),
        params(0.0, 0, 1.0, 0.0, 0.0),
    ];
    let logits = uniform(&mut r, rows.len() * vocab, 8.0);
    // Row 0 and 1 allow every third token, row 2 only the last token of the vocabulary,
    // row 3 everything (all bits set).
    let mut mask = vec![0u32; rows.len() * words];
    for t in (0..vocab).step_by(3) {
        for row in 0..2 {
            mask[row * words + t / 32] |= 1 << (t % 32);
        }
    }
    mask[2 * words + (vocab - 1) / 32] |= 1 << ((vocab - 1) % 32);
    mask[3 * words..].fill(u32::MAX);
    let flat: Vec<u32> = rows.iter().flatten().copied().collect();
    let (logits_d, params_d, mask_d) = (g.upload(&logits), g.upload(&flat), g.upload(&mask));
    let (tokens, fed) = (g.poisoned(rows.len() * 4), g.poisoned(rows.len() * 4));
    g.kernels
        .sample_rows(
            logits_d.ptr(),
            vocab,
            params_d.ptr(),
            Picks {
                host: tokens.ptr(),
                fed: fed.ptr(),
                slot: DPtr::NULL,
                stride: 0,
            },
            mask_d.ptr(),
            rows.len(),
        )
        .unwrap();
    let got = g.download(tokens.ptr::<u32>(), rows.len());
    assert_eq!(g.download(fed.ptr::<u32>(), rows.len()), got);
    let masked = |row: usize| -> Vec<f32> {
        (0..vocab)
            .map(|t| {
                let allowed = mask[row * words + t / 32] >> (t % 32) & 1 == 1;
                if allowed {
                    logits[row * vocab + t]
                } else {
                    f32::NEG_INFINITY
                }
            })
            .collect()
    };
    let want: Vec<u32> = rows
        .iter()
        .enumerate()
        .map(|(i, p)| reference_sample(&masked(i), p))
        .collect();
    assert_eq!(got, want);
    assert!(
        got[0].is_multiple_of(3) && got[1].is_multiple_of(3),
        "{got:?}"
    );
    assert_eq!(got[2] as usize, vocab - 1);
}
