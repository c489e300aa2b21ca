//! `parallax sample`: text from a trained language model, a token at a time. Each token is
//! drawn from the logits after the context (the prompt and what was drawn so far, its last
//! `seq` tokens): scaled by the temperature, cut to the `top_k` largest and to the smallest
//! set whose probability reaches `top_p`, then drawn with the `index`-th uniform of the
//! stream `(seed, Sample)`: the same seed gives the same text. Temperature 0 is greedy.
//!
//! On the CPU, a model that can be run a token at a time runs its decode-step plan while the
//! context fits in `seq` tokens, each attention's keys and values kept in caches between
//! tokens (`cached`): each new token costs one position's forward. Otherwise (a GPU, a model
//! that mixes positions other than through causal attention, or a context past `seq`
//! tokens, whose window slides and so moves every position) each token runs the training
//! plan's forward over the window of its last `seq` tokens, a shorter one padded after its
//! end: the logits at its last token do not see the padding because every attention of the
//! model is causal (checked). Both give the same logits (the tests compare them).

use super::cached::Cached;
use super::{model_output, UseError, Weights};
use crate::backend::Backend;
use crate::data::Values;
use crate::exec::Mode;
use crate::rng::{bits, stream, Purpose};
use crate::run::weights::FileShapes;
use crate::train::{backend, model_io, Device};
use parallax_compiler::ir::ops::Op;
use parallax_compiler::{Plan, Source};

/// How tokens are drawn.
#[derive(Debug, Clone, PartialEq)]
pub struct Options {
    pub max_new_tokens: usize,
    /// Divides the logits; 0 picks the most likely token (greedy).
    pub temperature: f64,
    pub top_k: Option<usize>,
    pub top_p: Option<f64>,
    pub seed: u64,
}

impl Options {
    /// Refuses values that draw nothing (a negative temperature, `top_k` 0, `top_p` outside
    /// (0, 1]).
    pub fn check(&self) -> Result<(), UseError> {
        let bad = |m: &str| Err(UseError::Asked(m.to_string()));
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return bad("--temperature must be 0 (greedy) or more");
        }
        if self.top_k == Some(0) {
            return bad("--top-k must be at least 1");
        }
        if let Some(p) = self.top_p {
            if !(p > 0.0 && p <= 1.0) {
                return bad("--top-p must be in (0, 1]");
            }
        }
        Ok(())
    }
}

/// The token drawn from `logits` with the uniform `u` in [0, 1).
pub fn pick(logits: &[f32], o: &Options, u: f64) -> u32 {
    let best = super::top_k(logits, 1).first().copied().unwrap_or(0);
    if o.temperature == 0.0 {
        return best as u32;
    }
    // Candidates, most likely first (ties: the lower id), cut to top_k.
    let k = o.top_k.unwrap_or(logits.len()).min(logits.len());
    let order = super::top_k(logits, k);
    let top = logits[best] as f64 / o.temperature;
    let weights: Vec<f64> = order
        .iter()
        .map(|&i| (logits[i] as f64 / o.temperature - top).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    // The smallest prefix whose probability reaches top_p (at least one token).
    let keep = match o.top_p {
        Some(p) => {
            let mut acc = 0.0;
            weights
                .iter()
                .position(|w| {
                    acc += w / total;
                    acc >= p
                })
                .map_or(weights.len(), |i| i + 1)
        }
        None => weights.len(),
    };
    let kept: f64 = weights[..keep].iter().sum();
    let target = u * kept;
    let mut acc = 0.0;
    for (j, w) in weights[..keep].iter().enumerate() {
        acc += w;
        if target < acc {
            return order[j] as u32;
        }
    }
    order[keep - 1] as u32
}

/// A language model's weights on a backend: the decode step with its key/value cache where
/// the model allows it (`cached`) while the context fits in `seq` tokens, else the full
/// forward over the window of its last `seq` tokens.
pub struct Generator {
    /// The decode step, if the model can be cached.
    cache: Option<Cached>,
    full: Full,
    pub seq: usize,
    /// The ids the model knows (its embedding's rows, or its output classes).
    pub vocab: usize,
    /// Why the key/value cache is not used (`None`: it is): the model mixes positions other
    /// than through causal attention, or runs on a GPU.
    pub uncached: Option<String>,
}

/// The training plan's forward, built the first time it is needed: at once without a
/// cache, else when a context first passes `seq` tokens (a window that slides moves every
/// token's position, so each draw past `seq` needs the whole window's forward, which one
/// pass over the window computes faster than `seq` decode steps).
enum Full {
    Ready(Window),
    Later(Box<Pending>),
}

/// What builds the full-window forward.
struct Pending {
    plan: Plan,
    device: Device,
    weights: Weights,
    seed: u64,
    input: String,
    target: String,
}

/// The training plan's forward over a window of `seq` tokens, padded after the context.
struct Window {
    exec: Box<dyn Backend>,
    input: String,
    target: String,
    output: String,
}

impl Generator {
    /// The model of `plan` with `weights`, on `device` (one device), if it is a language
    /// model with causal attention: its decode step with a key/value cache on the CPU, when
    /// the model can be run a token at a time, else the full-window forward.
    pub fn new(
        source: &Source,
        plan: Plan,
        device: Device,
        weights: &Weights,
    ) -> Result<Generator, UseError> {
        Generator::build(source, plan, device, weights, true)
    }

    /// Like `new`, but always the full-window forward (what the cache is checked against).
    pub fn full_window(
        source: &Source,
        plan: Plan,
        device: Device,
        weights: &Weights,
    ) -> Result<Generator, UseError> {
        Generator::build(source, plan, device, weights, false)
    }

    fn build(
        source: &Source,
        plan: Plan,
        device: Device,
        weights: &Weights,
        cache: bool,
    ) -> Result<Generator, UseError> {
        let (io, input, target) = model_io(&plan, &source.experiment.loss)?;
        let seq = match (&io.input.shape[..], io.integer_input(), io.class_target()) {
            ([seq], true, true) if io.target.shape == [*seq] => *seq,
            _ => {
                return Err(UseError::Model(format!(
                    "sample generates text with a language model (token ids in, a next-token class at each position out); this model reads {} and predicts {}: `parallax predict` runs a classifier",
                    io.input.show(),
                    io.target.show()
                )))
            }
        };
        if plan
            .steps
            .iter()
            .any(|s| matches!(s.op, Op::Attention { causal: false, .. }))
        {
            return Err(UseError::Model(
                "sample reads the logits after a context shorter than the model's sequence, which needs every attention to be causal (`causal: true`); this model attends to later positions".into(),
            ));
        }
        let vocab = match (io.input_range, io.classes) {
            (Some(a), Some(b)) => a.min(b),
            (a, b) => a.or(b).unwrap_or(0),
        };
        let cached = match cache {
            true => Cached::new(source, &input, &device, weights),
            false => Err("the full-window forward was asked for".into()),
        };
        let mut full = Full::Later(Box::new(Pending {
            plan,
            device,
            weights: weights.clone(),
            seed: source.experiment.train.seed,
            input,
            target,
        }));
        let (cache, uncached) = match cached {
            Ok(c) => (Some(c), None),
            Err(why) => {
                full.ready()?;
                (None, Some(why))
            }
        };
        Ok(Generator {
            cache,
            full,
            seq,
            vocab,
            uncached,
        })
    }

    /// Whether tokens are drawn through the decode step's key/value cache (while the context
    /// fits in `seq` tokens).
    pub fn cached(&self) -> bool {
        self.cache.is_some()
    }

    /// Bytes of the key and value caches (0 without a cache).
    pub fn cache_bytes(&self) -> u64 {
        self.cache.as_ref().map_or(0, |c| c.cache_bytes)
    }

    /// What a generation of `drawn` tokens was: how many, with what, how (`sample`'s last
    /// line).
    pub fn describe(&self, drawn: usize, codec: &str, options: &Options) -> String {
        let path = match &self.uncached {
            None => format!("a key/value cache of {} bytes", self.cache_bytes()),
            Some(why) => format!("the full window for every token: {why}"),
        };
        let (seed, temperature) = (options.seed, options.temperature);
        format!("{drawn} tokens drawn ({codec}, seed {seed}, temperature {temperature}; {path})")
    }

    /// The logits that follow `context` (its last `seq` tokens).
    pub fn next_logits(&mut self, context: &[u32]) -> Result<Vec<f32>, UseError> {
        let from = context.len().saturating_sub(self.seq);
        let window = &context[from..];
        if window.is_empty() {
            return Err(UseError::Asked(
                "the prompt is empty: give at least one token".into(),
            ));
        }
        match &mut self.cache {
            Some(c) if from == 0 => c.next_logits(window),
            _ => self.full.ready()?.next_logits(window, self.seq),
        }
    }

    /// Draws up to `o.max_new_tokens` tokens after `prompt`, each handed to `on_token` as it
    /// is drawn (which may stop the generation by returning `false`).
    pub fn generate(
        &mut self,
        prompt: &[u32],
        o: &Options,
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<Vec<u32>, UseError> {
        o.check()?;
        if let Some(&t) = prompt.iter().find(|&&t| t as usize >= self.vocab) {
            return Err(UseError::Asked(format!(
                "the prompt holds token {t}, beyond the model's vocabulary of {}",
                self.vocab
            )));
        }
        let rng = stream(o.seed, Purpose::Sample, 0);
        let mut context = prompt.to_vec();
        let mut drawn = Vec::with_capacity(o.max_new_tokens);
        for i in 0..o.max_new_tokens {
            let logits = self.next_logits(&context)?;
            let u = (bits(rng, i as u64) >> 11) as f64 / (1u64 << 53) as f64;
            let t = pick(&logits[..self.vocab.min(logits.len())], o, u);
            context.push(t);
            drawn.push(t);
            if !on_token(t) {
                break;
            }
        }
        Ok(drawn)
    }
}

impl Full {
    /// The forward, built if it was not yet.
    fn ready(&mut self) -> Result<&mut Window, UseError> {
        if let Full::Later(p) = self {
            let output = model_output(&p.plan)?;
            let files = FileShapes::of(&p.plan);
            let (mut exec, _) = backend(p.plan.clone(), p.device, &None, 1, p.seed)?;
            p.weights.load(exec.as_mut(), &files)?;
            let (input, target) = (std::mem::take(&mut p.input), std::mem::take(&mut p.target));
            *self = Full::Ready(Window {
                exec,
                input,
                target,
                output,
            });
        }
        match self {
            Full::Ready(w) => Ok(w),
            Full::Later(_) => unreachable!("built above"),
        }
    }
}

impl Window {
    /// The logits after `window` (1 to `seq` tokens): the whole window's forward, padded.
    fn next_logits(&mut self, window: &[u32], seq: usize) -> Result<Vec<f32>, UseError> {
        let mut ids = vec![0i32; seq];
        for (d, &t) in ids.iter_mut().zip(window) {
            *d = t as i32;
        }
        let e = self.exec.as_mut();
        e.set_input(&self.input, 1, &Values::I32(ids))?;
        e.set_input(&self.target, 1, &Values::I32(vec![0; seq]))?;
        e.run(1, Mode::Eval, 0, 0)?;
        let out = e.output_values(&self.output, 1)?.ok_or_else(|| {
            UseError::Model(format!("the model's output `{}` was not kept", self.output))
        })?;
        let v = out.f32();
        let c = v.len() / seq;
        let at = window.len() - 1;
        Ok(v[at * c..(at + 1) * c].to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(temperature: f64, top_k: Option<usize>, top_p: Option<f64>) -> Options {
        Options {
            max_new_tokens: 1,
            temperature,
            top_k,
            top_p,
            seed: 0,
        }
    }

    #[test]
    fn temperature_zero_is_the_argmax() {
        for u in [0.0, 0.5, 0.999] {
            assert_eq!(pick(&[0.1, 3.0, 2.0, 3.0], &opts(0.0, None, None), u), 1);
        }
    }

    #[test]
    fn draws_follow_the_softmax() {
        // Probabilities of [ln 1, ln 2, ln 1] at temperature 1: 1/4, 1/2, 1/4, visited most
        // likely first: id 1 on [0, .5), id 0 on [.5, .75), id 2 on [.75, 1).
        let l = [0.0f32, 2f32.ln(), 0.0];
        let o = opts(1.0, None, None);
        assert_eq!(pick(&l, &o, 0.49), 1);
        assert_eq!(pick(&l, &o, 0.51), 0);
        assert_eq!(pick(&l, &o, 0.76), 2);
        // Temperature 2 flattens: weights 1, sqrt 2, 1.
        let o2 = opts(2.0, None, None);
        let s = 2f64.sqrt() / (2.0 + 2f64.sqrt());
        assert_eq!(pick(&l, &o2, s - 1e-6), 1);
        assert_eq!(pick(&l, &o2, s + 1e-6), 0);
    }

    #[test]
    fn top_k_and_top_p_cut_the_tail() {
        let l = [0.0f32, 2f32.ln(), 0.0];
        // top_k 1: always the best.
        assert_eq!(pick(&l, &opts(1.0, Some(1), None), 0.99), 1);
        // top_k 2: ids 1 and 0, renormalised to 2/3 and 1/3.
        assert_eq!(pick(&l, &opts(1.0, Some(2), None), 0.66), 1);
        assert_eq!(pick(&l, &opts(1.0, Some(2), None), 0.67), 0);
        // top_p 0.5: id 1 alone reaches it.
        assert_eq!(pick(&l, &opts(1.0, None, Some(0.5)), 0.99), 1);
        // top_p 0.6: ids 1 and 0.
        assert_eq!(pick(&l, &opts(1.0, None, Some(0.6)), 0.99), 0);
    }

    #[test]
    fn options_that_draw_nothing_are_refused() {
        assert!(opts(-1.0, None, None).check().is_err());
        assert!(opts(f64::NAN, None, None).check().is_err());
        assert!(opts(1.0, Some(0), None).check().is_err());
        assert!(opts(1.0, None, Some(0.0)).check().is_err());
        assert!(opts(1.0, None, Some(1.5)).check().is_err());
        assert!(opts(0.8, Some(200), Some(0.9)).check().is_ok());
    }
}

#[cfg(test)]
#[path = "sample_tests.rs"]
mod cache_tests;
