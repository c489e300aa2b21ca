//! `parallax sample`: text from a trained language model (the library part is
//! `parallax_runtime::trained::sample`), encoded and decoded with the tokenizer its token
//! files were written with.

use crate::trained::{open, RunArgs};
use crate::{fail, Exit};
use parallax_runtime::data::codec::{tokenizer_of, Codec, TextStream};
use parallax_runtime::trained::sample::{Generator, Options};
use std::io::Write;
use std::path::{Path, PathBuf};

#[derive(clap::Args)]
pub(crate) struct Args {
    #[command(flatten)]
    run: RunArgs,
    /// The text to continue.
    #[arg(long, default_value = "\n")]
    prompt: String,
    #[arg(long, default_value_t = 500)]
    max_new_tokens: usize,
    /// Divides the logits before the softmax: below 1 sharper, above 1 flatter; 0 always picks
    /// the most likely token.
    #[arg(long, default_value_t = 0.8)]
    temperature: f64,
    /// Draw only among the K most likely tokens.
    #[arg(long, value_name = "K", default_value_t = 200)]
    top_k: usize,
    /// Draw only among the most likely tokens whose probabilities reach P together.
    #[arg(long, value_name = "P")]
    top_p: Option<f64>,
    /// The same seed gives the same text.
    #[arg(long, default_value_t = 1337)]
    seed: u64,
    /// The tokenizer file (default: the one `parallax tokenize` wrote beside the run's token
    /// files).
    #[arg(long, value_name = "FILE")]
    tokenizer: Option<PathBuf>,
    /// Print the token ids, a line each, instead of text.
    #[arg(long)]
    ids: bool,
}

pub(crate) fn run(args: Args) -> Result<(), Exit> {
    let run_dir = args.run.run.clone();
    let (p, weights) = open(&args.run, &[], None, None)?;
    let path = match &args.tokenizer {
        Some(t) => t.clone(),
        None => tokenizer_of(&p.source.experiment.data, Path::new("."))
            .map_err(|e| fail(&run_dir, e))?
            .ok_or_else(|| fail(&run_dir, "the run's data names no tokenizer and none lies beside its token files; give --tokenizer FILE (`parallax tokenize` writes PREFIX_tokenizer.json)"))?,
    };
    let codec = Codec::open(&path).map_err(|e| fail(&path, e))?;
    let prompt = codec
        .encode(&args.prompt)
        .map_err(|e| fail(&path, format!("--prompt: {e}")))?;
    let options = Options {
        max_new_tokens: args.max_new_tokens,
        temperature: args.temperature,
        top_k: Some(args.top_k),
        top_p: args.top_p,
        seed: args.seed,
    };
    let mut g = Generator::new(&p.source, p.decided.plan, p.decided.device, &weights)
        .map_err(|e| fail(&run_dir, e))?;
    if codec.vocab_size() > g.vocab {
        errln!(
            "{}: warning: the tokenizer ({}) knows more ids than the model's {}",
            path.display(),
            codec.describe(),
            g.vocab
        );
    }
    // The prompt, then the text as it is drawn (a character split across tokens waits for
    // its rest), as nanoGPT's sample.py prints them.
    let mut stdout = std::io::stdout().lock();
    if !args.ids {
        let _ = write!(stdout, "{}", args.prompt);
    }
    let mut text = TextStream::default();
    let mut broken = false;
    let mut on_token = |t: u32| {
        broken = match args.ids {
            true => writeln!(stdout, "{t}").is_err(),
            false => text
                .push(&codec, t)
                .is_some_and(|s| write!(stdout, "{s}").and_then(|_| stdout.flush()).is_err()),
        };
        !broken
    };
    let drawn = g
        .generate(&prompt, &options, &mut on_token)
        .map_err(|e| fail(&run_dir, e))?;
    if !args.ids && !broken {
        let _ = writeln!(std::io::stdout(), "{}", text.rest(&codec));
    }
    let how = g.describe(drawn.len(), &codec.describe(), &options);
    errln!("{}: {how}", weights.describe());
    Ok(())
}
