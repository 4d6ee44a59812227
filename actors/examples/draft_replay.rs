//! Replays speculative decoding's draft sizing on real text, without a GPU.
//!
//! Greedy text does not depend on how it was drafted, so one greedy generation per prompt (on
//! the CPU) fixes every step a policy could take: at each position, prompt lookup's proposal
//! and how much of it the target keeps. This tool generates each prompt of a file once, then
//! walks the answer under each draft-sizing policy with the step costs given on the command
//! line (a GPU's, say, measured by `snapserve bench --verify-width 8`) and prints the steps,
//! the drafted and kept tokens and the predicted speed against no speculation.
//!
//!     cargo run --release -p actors --example draft_replay -- MODEL_DIR PROMPTS_FILE \
//!         [--plain-ms 0.543] [--verify-fixed-ms 0.87] [--verify-token-ms 0.015] [--gap-ms 0.05]
//!
//! `--gap-ms` is what a step costs more when the scheduler cannot plan it while the step
//! before runs (it must see a speculating request's token before drafting after it).

use std::path::PathBuf;

use engine::chat::ChatMessage;
use engine::cpu::{CpuBackend, CpuOptions};
use engine::generate::{Vocabulary, generate};
use engine::model::ModelFiles;
use engine::sampling::SamplingParams;
use engine::speculative::{DraftSource, PromptLookup};
use policy::{Acceptance, DraftCost, DraftOffer, StepTimeFit, draft_lengths};

struct Costs {
    ngram_min: usize,
    plain: f64,
    verify: StepTimeFit,
    gap: f64,
}

#[derive(Clone, Copy)]
enum Sizing {
    Whole,
    /// One kept-rate for every drafted position (the sizing before the two-part acceptance).
    OneRate,
    ByCost,
}

/// The one-rate estimate of the sizing before: kept over looked, recent ones weighing most.
struct OneRate {
    kept: f64,
    looked: f64,
}

impl OneRate {
    fn observe(&mut self, drafted: usize, kept: usize) {
        let looked = kept + usize::from(kept < drafted);
        for i in 0..looked {
            self.kept = self.kept * 0.85 + f64::from(u8::from(i < kept));
            self.looked = self.looked * 0.85 + 1.0;
        }
    }

    fn declined(&mut self) {
        self.kept = self.kept * 0.95 + 4.0 * 0.05;
        self.looked = self.looked * 0.95 + 5.0 * 0.05;
    }
}

struct Outcome {
    steps: usize,
    drafted: usize,
    kept: usize,
    seconds: f64,
}

fn replay(
    context: &[u32],
    answer: &[u32],
    max_new: usize,
    sizing: Sizing,
    plan_ahead: bool,
    c: &Costs,
) -> Outcome {
    let mut lookup = PromptLookup {
        ngram_min: c.ngram_min,
        ngram_max: 3,
    };
    let mut acceptance = Acceptance::default();
    let mut one = OneRate {
        kept: 4.0,
        looked: 5.0,
    };
    let cost = DraftCost {
        plain_seconds: c.plain,
        verify: c.verify,
    };
    let mut tokens = context.to_vec();
    // The first answer token comes from the prefill.
    tokens.push(answer[0]);
    let mut done = 1;
    let mut out = Outcome {
        steps: 0,
        drafted: 0,
        kept: 0,
        seconds: 0.0,
    };
    while done < answer.len() {
        let room = max_new.saturating_sub(done + 1).min(7);
        // Whether a draft could pay, judged before the token is known: where none could, the
        // step is planned while the one before it runs (no gap) and drafts nothing.
        let may_pay = match sizing {
            Sizing::Whole => true,
            Sizing::OneRate => {
                let rate = one.kept / one.looked;
                let offer = DraftOffer {
                    first: rate,
                    after_kept: rate,
                    proposed: 7,
                };
                draft_lengths(&[offer], 1, 1, Some(cost))[0] > 0
            }
            Sizing::ByCost => draft_lengths(&[acceptance.offer(7)], 1, 1, Some(cost))[0] > 0,
        };
        if plan_ahead && !may_pay {
            acceptance.declined();
            one.declined();
            out.seconds += c.plain;
            out.steps += 1;
            tokens.push(answer[done]);
            done += 1;
            continue;
        }
        let proposal = lookup.propose(&tokens, room);
        let length = if proposal.is_empty() {
            0
        } else {
            let offer = match sizing {
                Sizing::OneRate => {
                    let rate = one.kept / one.looked;
                    DraftOffer {
                        first: rate,
                        after_kept: rate,
                        proposed: proposal.len(),
                    }
                }
                _ => acceptance.offer(proposal.len()),
            };
            let priced = match sizing {
                Sizing::Whole => None,
                _ => Some(cost),
            };
            draft_lengths(&[offer], 1, 1, priced)[0]
        };
        let kept = proposal[..length]
            .iter()
            .zip(&answer[done..])
            .take_while(|(a, b)| a == b)
            .count();
        if !proposal.is_empty() && length == 0 {
            acceptance.declined();
            one.declined();
        } else if length > 0 {
            acceptance.observe(length, kept);
            one.observe(length, kept);
        }
        let step = if length == 0 {
            c.plain
        } else {
            c.verify.seconds(1 + length).max(c.plain)
        };
        out.seconds += step + c.gap;
        out.steps += 1;
        out.drafted += length;
        out.kept += kept;
        let made = (kept + 1).min(answer.len() - done);
        tokens.extend_from_slice(&answer[done..done + made]);
        done += made;
    }
    out
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let (Some(model), Some(prompts)) = (args.next(), args.next()) else {
        return Err("usage: draft_replay MODEL_DIR PROMPTS_FILE [--plain-ms X] [--verify-fixed-ms X] [--verify-token-ms X] [--gap-ms X]".into());
    };
    let (mut plain, mut fixed, mut per_token, mut gap, mut ngram_min) =
        (0.543, 0.87, 0.015, 0.05, 1.0);
    while let Some(flag) = args.next() {
        let value: f64 = args.next().ok_or("a flag without its value")?.parse()?;
        match flag.as_str() {
            "--plain-ms" => plain = value,
            "--verify-fixed-ms" => fixed = value,
            "--verify-token-ms" => per_token = value,
            "--gap-ms" => gap = value,
            "--ngram-min" => ngram_min = value,
            other => return Err(format!("unknown flag {other}").into()),
        }
    }
    let costs = Costs {
        ngram_min: ngram_min as usize,
        plain: plain / 1e3,
        verify: StepTimeFit {
            fixed_seconds: fixed / 1e3,
            per_token_seconds: per_token / 1e3,
        },
        gap: gap / 1e3,
    };
    let files = ModelFiles::open(&PathBuf::from(model))?;
    let template = files
        .chat_template
        .as_ref()
        .ok_or("the model has no chat template")?;
    let max_new = 160;
    let mut backend = CpuBackend::load(&files, &CpuOptions::for_tokens(1024))?;
    let vocab = Vocabulary {
        tokenizer: &files.tokenizer,
        eos_token_ids: &files.eos_token_ids,
    };
    println!(
        "costs: plain {plain} ms, verify {fixed} ms + {per_token} ms a token, {gap} ms more a step while speculating"
    );
    println!("| prompt | tokens | policy | steps | drafted / kept | predicted × off |");
    println!("|---|---:|---|---:|---|---:|");
    for (i, line) in std::fs::read_to_string(prompts)?
        .lines()
        .filter(|l| !l.trim().is_empty())
        .enumerate()
    {
        let rendered = template.render(&[ChatMessage::new("user", line.trim())], true)?;
        let prompt = files.tokenizer.encode_rendered(&rendered)?;
        let params = SamplingParams {
            temperature: 0.0,
            max_tokens: max_new,
            ..SamplingParams::default()
        };
        let generation = generate(&mut backend, &vocab, &prompt, &params, 512, |_| {})?;
        let answer = &generation.tokens;
        let off = (answer.len() - 1) as f64 * costs.plain;
        for (name, sizing) in [
            ("whole", Sizing::Whole),
            ("by_cost, one rate", Sizing::OneRate),
            ("by_cost, two-part", Sizing::ByCost),
        ] {
            for plan_ahead in [false, true] {
                if plan_ahead && matches!(sizing, Sizing::Whole) {
                    continue;
                }
                let o = replay(&prompt, answer, max_new, sizing, plan_ahead, &costs);
                let name = if plan_ahead {
                    format!("{name}, planned ahead where no draft can pay")
                } else {
                    name.to_string()
                };
                println!(
                    "| {} | {} | {name} | {} | {} / {} | {:.2}× |",
                    i + 1,
                    answer.len(),
                    o.steps,
                    o.drafted,
                    o.kept,
                    off / o.seconds
                );
            }
        }
    }
    Ok(())
}
