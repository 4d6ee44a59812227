//! Which samplers the GPU serves, and their parameters as `kernels/sampling.cu` reads them.
//!
//! The GPU applies temperature, top-k, top-p and min-p and draws with a uniform taken from the
//! request's own sampler, so a seeded request stays reproducible. Penalties need the request's
//! token history, which stays on the host, logit biases their map, and logprobs and grammars
//! the whole row: such rows ([`Sampler::needs_host`]) are sampled there from downloaded logits.

use super::kernels::SAMPLE_PARAM_WORDS;
use crate::sampling::Sampler;

/// Appends one row's parameters. A stochastic row draws its uniform from `sampler` now.
pub fn push_params(sampler: &mut Sampler, out: &mut Vec<u32>) {
    let p = sampler.params().clone();
    let uniform = if p.temperature == 0.0 {
        0.0
    } else {
        sampler.draw_uniform()
    };
    let bits = uniform.to_bits();
    out.extend([
        p.temperature.to_bits(),
        p.top_k.min(u32::MAX as usize) as u32,
        p.top_p.to_bits(),
        p.min_p.to_bits(),
        bits as u32,
        (bits >> 32) as u32,
    ]);
    debug_assert_eq!(out.len() % SAMPLE_PARAM_WORDS, 0);
}

/// Appends the parameters of a row the GPU only takes the argmax of (its token is unused, or
/// the host samples it from the logits, which greedy rows leave untouched).
pub fn push_greedy(out: &mut Vec<u32>) {
    out.extend([0u32; SAMPLE_PARAM_WORDS]);
}
