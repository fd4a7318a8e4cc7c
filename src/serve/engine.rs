//! The engine thread: it owns the model and runs continuous batching: every loop admits waiting
//! requests (a new one joins between decode steps), runs new prompts, and advances every
//! decoding sequence by one token in a single batched forward (each sequence keeps its own KV
//! cache). A sequence whose client went away is dropped before the next step. Requests wait in
//! a queue bounded by the HTTP layer's admission count, and for at most `max_queue_wait`: one
//! that waited longer is answered `Event::QueueTimeout` (a 429) instead of running. Texts to
//! embed share the loop: each step embeds waiting texts up to the step's token budget before the
//! decode step, so neither kind of work starves the other.

use std::collections::{HashSet, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use models::{CausalLm, ServingAdapter};
use tokio::sync::mpsc::UnboundedSender;

use super::metrics::Metrics;
use crate::embed::Pooling;
use crate::generate::prefix_cache::PrefixCache;
use crate::generate::{step_all, FinishReason, SamplingParams, Sequence, TokenLogprob};
use crate::tokenize::TextTokenizer;

/// One sequence to generate.
pub struct Job {
    pub prompt_ids: Vec<u32>,
    pub params: SamplingParams,
    /// The grammar the answer must follow (`response_format`, a forced call).
    pub constraint: Option<llguidance::Matcher>,
    /// Ends the answer (finish reason `stop`) once the text it is handed, piece by piece, says
    /// so: a forced list of calls that repeats one (`tools::Tools::repeat_watch`).
    pub stop_when: Option<StopWhen>,
    /// The LoRA adapter the answer runs with over the engine's model (multi-LoRA serving).
    pub adapter: Option<Arc<ServingAdapter>>,
    /// The client's `prompt_cache_key`, a hint for the prefix cache.
    pub cache_key: Option<String>,
    /// A reasoning model's answer: its thinking is followed (`Sequence::expect_thinking`;
    /// true: the prompt opened the block).
    pub thinking: Option<bool>,
    pub events: UnboundedSender<Event>,
    pub enqueued: Instant,
}

/// One text to embed: its pooled vector (not scaled), or why it failed, goes to `reply`.
pub struct EmbedJob {
    pub ids: Vec<u32>,
    pub pooling: Pooling,
    pub reply: tokio::sync::oneshot::Sender<Result<Vec<f32>, String>>,
}

/// What the engine is handed.
enum Work {
    // Boxed: a job is large (its sampling settings and grammar), an embedding small.
    Generate(Box<Job>),
    Embed(EmbedJob),
}

/// Reads an answer's text as it is generated; true: end the answer now.
pub type StopWhen = Box<dyn FnMut(&str) -> bool + Send>;

/// What the engine reports about a sequence.
#[derive(Debug, Clone)]
pub enum Event {
    /// The prompt's tokens 1.. scored (first, when asked for).
    PromptLogprobs(Vec<TokenLogprob>),
    /// A sampled token (None: text released at the end) and the text now safe to show.
    Delta {
        text: String,
        token: Option<u32>,
        logprob: Option<TokenLogprob>,
    },
    Done {
        finish: FinishReason,
        prompt_tokens: usize,
        completion_tokens: usize,
        /// Prompt tokens whose keys and values came from the prefix cache.
        cached_tokens: usize,
        /// The sum of the sampled tokens' log-probabilities, when the request ranks its answers
        /// (`OutputControls::cumulative_logprob`; else 0).
        cumulative_logprob: f64,
        /// Tokens of the answer's thinking (0 without).
        reasoning_tokens: usize,
        /// The stop string that ended the answer, if one did (Anthropic's `stop_sequence`).
        stop_string: Option<String>,
    },
    Error(String),
    /// The sequence waited in the queue longer than `EngineSettings::max_queue_wait` and was
    /// not run.
    QueueTimeout {
        waited: Duration,
    },
}

/// The handle the HTTP side keeps.
#[derive(Clone)]
pub struct EngineHandle {
    jobs: mpsc::Sender<Work>,
    /// Sequences being generated now.
    pub running: Arc<AtomicUsize>,
}

impl EngineHandle {
    pub fn submit(&self, job: Job) -> Result<(), String> {
        self.jobs.send(Work::Generate(Box::new(job))).map_err(|_| "the engine has stopped".to_string())
    }

    pub fn submit_embed(&self, job: EmbedJob) -> Result<(), String> {
        self.jobs.send(Work::Embed(job)).map_err(|_| "the engine has stopped".to_string())
    }
}

/// Embeds waiting texts, oldest first, up to `budget` tokens (at least one text); a text whose
/// client went away is skipped.
fn embed_some(model: &CausalLm, to_embed: &mut VecDeque<EmbedJob>, budget: usize) {
    let mut spent = 0;
    while let Some(job) = to_embed.front() {
        if spent > 0 && spent + job.ids.len() > budget {
            break;
        }
        let job = to_embed.pop_front().expect("a front job");
        if job.reply.is_closed() {
            continue;
        }
        spent += job.ids.len();
        let _ = job.reply.send(crate::embed::pooled(model, &job.ids, job.pooling).map_err(|e| format!("{e:#}")));
    }
}

struct Running {
    seq: Sequence,
    job: Job,
    last_token_at: Option<Instant>,
}

/// How an engine schedules.
#[derive(Debug, Clone, Copy)]
pub struct EngineSettings {
    /// Sequences that advance together (more wait in the queue).
    pub max_running: usize,
    /// Tokens one step runs at most, decode steps first, prompts in chunks of the rest
    /// (`step_all`).
    pub max_batched_tokens: usize,
    /// Bytes of KV blocks the prefix cache keeps (0: none).
    pub prefix_cache_bytes: usize,
    /// Longest a sequence waits for a slot before it is answered `Event::QueueTimeout` (None:
    /// no limit).
    pub max_queue_wait: Option<Duration>,
}

/// Starts the engine thread.
pub fn start(
    model: CausalLm,
    tokenizer: Arc<TextTokenizer>,
    eos: HashSet<u32>,
    settings: EngineSettings,
    metrics: Arc<Metrics>,
) -> EngineHandle {
    let (tx, rx) = mpsc::channel::<Work>();
    let running = Arc::new(AtomicUsize::new(0));
    let handle = EngineHandle { jobs: tx, running: running.clone() };
    std::thread::Builder::new()
        .name("engine".into())
        .spawn(move || run(model, tokenizer, eos, settings, rx, running, metrics))
        .expect("spawning the engine thread");
    handle
}

fn run(
    model: CausalLm,
    tokenizer: Arc<TextTokenizer>,
    eos: HashSet<u32>,
    settings: EngineSettings,
    rx: mpsc::Receiver<Work>,
    running_count: Arc<AtomicUsize>,
    metrics: Arc<Metrics>,
) {
    let (max_running, max_batched_tokens) = (settings.max_running.max(1), settings.max_batched_tokens.max(1));
    let mut prefixes = PrefixCache::new(settings.prefix_cache_bytes);
    let mut active: Vec<Running> = vec![];
    // Jobs received and not yet running, oldest first.
    let mut waiting: VecDeque<Job> = VecDeque::new();
    let mut to_embed: VecDeque<EmbedJob> = VecDeque::new();
    let take = |work: Work, waiting: &mut VecDeque<Job>, to_embed: &mut VecDeque<EmbedJob>| match work {
        Work::Generate(job) => waiting.push_back(*job),
        Work::Embed(job) => to_embed.push_back(job),
    };
    loop {
        // Block only when idle; else take what arrived since the last step.
        if active.is_empty() && waiting.is_empty() && to_embed.is_empty() {
            // Idle: what the last requests freed goes back to the OS before we wait.
            crate::memory::return_free_memory();
            match rx.recv() {
                Ok(w) => take(w, &mut waiting, &mut to_embed),
                Err(_) => return,
            }
        }
        for w in rx.try_iter() {
            take(w, &mut waiting, &mut to_embed);
        }
        embed_some(&model, &mut to_embed, max_batched_tokens);
        // Gone clients' jobs leave the queue; jobs past the wait limit are answered.
        let now = Instant::now();
        waiting.retain(|job| {
            let waited = now - job.enqueued;
            match settings.max_queue_wait {
                _ if job.events.is_closed() => false,
                Some(limit) if waited > limit => {
                    metrics.queue_timeout();
                    let _ = job.events.send(Event::QueueTimeout { waited });
                    false
                }
                _ => true,
            }
        });
        // Admit new sequences between decode steps.
        while active.len() < max_running {
            let Some(mut job) = waiting.pop_front() else { break };
            match Sequence::new(&model, &job.prompt_ids, &eos, &job.params) {
                Ok(mut seq) => {
                    if let Some(m) = job.constraint.take() {
                        seq.constrain(m);
                    }
                    if let Some(a) = job.adapter.take() {
                        seq.adapt(a);
                    }
                    if let Some(inside) = job.thinking {
                        seq.expect_thinking(inside);
                    }
                    let blocks = prefixes.lookup(seq.namespace(), &job.prompt_ids, seq.reusable_prompt_blocks());
                    if let Err(e) = seq.reuse_prefix(&model, &blocks) {
                        let _ = job.events.send(Event::Error(format!("{e:#}")));
                        continue;
                    }
                    active.push(Running { seq, job, last_token_at: None })
                }
                Err(e) => {
                    let _ = job.events.send(Event::Error(format!("{e:#}")));
                }
            }
        }
        // A client that disconnected: free its slot now.
        active.retain(|r| {
            let gone = r.job.events.is_closed();
            if gone {
                metrics.cancelled();
            }
            !gone
        });
        running_count.store(active.len(), Ordering::SeqCst);
        // One step for every sequence: the decoding ones as one batched forward.
        let results = {
            let mut seqs: Vec<&mut Sequence> = active.iter_mut().map(|r| &mut r.seq).collect();
            step_all(&model, &tokenizer, &mut seqs, max_batched_tokens)
        };
        let now = Instant::now();
        let mut done = vec![false; active.len()];
        for ((r, result), done) in active.iter_mut().zip(results).zip(done.iter_mut()) {
            *done = match result {
                Ok(step) => {
                    if step.token.is_some() || step.finished.is_some() {
                        match r.last_token_at {
                            None => metrics.time_to_first_token((now - r.job.enqueued).as_secs_f64()),
                            Some(t) => metrics.inter_token_latency((now - t).as_secs_f64()),
                        }
                        r.last_token_at = Some(now);
                    }
                    if step.token.is_some() {
                        metrics.generated_tokens(1);
                    }
                    if step.token.is_some() && r.seq.generated_ids().len() == 1 {
                        // The prompt is in: its blocks serve the next prompt that starts alike.
                        let (tokens, cache) = r.seq.cached();
                        prefixes.insert(r.seq.namespace(), tokens, cache, r.job.cache_key.as_deref());
                    }
                    if let Some(scored) = step.prompt_logprobs {
                        let _ = r.job.events.send(Event::PromptLogprobs(scored));
                    }
                    let mut finished = step.finished;
                    if let Some(stop) = r.job.stop_when.as_mut() {
                        if stop(&step.text) && finished.is_none() {
                            finished = Some(FinishReason::Stop);
                        }
                    }
                    if !step.text.is_empty() || step.token.is_some() {
                        let _ = r.job.events.send(Event::Delta { text: step.text, token: step.token, logprob: step.logprob });
                    }
                    match finished {
                        Some(finish) => {
                            let (tokens, cache) = r.seq.cached();
                            prefixes.insert(r.seq.namespace(), tokens, cache, r.job.cache_key.as_deref());
                            let _ = r.job.events.send(Event::Done {
                                finish,
                                prompt_tokens: r.seq.prompt_ids().len(),
                                completion_tokens: r.seq.generated_ids().len(),
                                cached_tokens: r.seq.cached_prompt_tokens(),
                                cumulative_logprob: r.seq.cumulative_logprob(),
                                reasoning_tokens: r.seq.reasoning_tokens(),
                                stop_string: r.seq.stop_string().map(str::to_string),
                            });
                            true
                        }
                        None => false,
                    }
                }
                Err(e) => {
                    let _ = r.job.events.send(Event::Error(format!("{e:#}")));
                    true
                }
            };
        }
        let mut flags = done.into_iter();
        active.retain(|_| !flags.next().unwrap());
        metrics.prefix_cache_bytes(prefixes.used_bytes());
        running_count.store(active.len(), Ordering::SeqCst);
    }
}
