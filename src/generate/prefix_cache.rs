//! Prefix caching (vLLM's automatic prefix caching): the KV blocks of prompts already run are
//! kept, keyed by their tokens and everything before them, so a prompt that starts the same
//! way (the next turn of a chat, a shared system prompt, an agent loop's growing history)
//! takes those blocks instead of computing them again.
//!
//! A block is [`KV_BLOCK`] positions of every layer, shared by reference (`SharedBlock`), so a
//! hit costs no copy and no memory beyond what is cached. An entry's key is (its parent entry,
//! its own tokens): a lookup walks from the root of the sequence's namespace (the base model,
//! or one loaded adapter: an adapter changes every layer's keys and values) block by block and
//! stops at the first miss, and equal keys mean equal prefixes exactly (no hash collisions to
//! trust). The cache holds at most `budget` bytes of blocks; past that the least recently used
//! leaf goes first (a block whose children are gone: an inner block is reachable only through
//! its parent, so leaves are evicted before what leads to them).
//!
//! A client's `prompt_cache_key` names a conversation (OpenAI's hint for routing requests that
//! share a prefix to one cache). One server needs no routing, and a hit needs no name (keys
//! are the tokens), so the name serves eviction instead: the last prompt of each named
//! conversation is kept while unnamed leaves can go, so an agent's or a chat's history
//! survives a burst of one-off requests. At most [`NAMED`] names are remembered.

use std::collections::{HashMap, HashSet};

use models::{KvCache, SharedBlock, KV_BLOCK};

/// Conversations (`prompt_cache_key`s) whose last prompt is kept before unnamed ones.
pub const NAMED: usize = 256;

/// Which model's keys and values a block holds: the base, or one loaded adapter instance.
pub type Namespace = Option<u64>;

struct Entry {
    id: u64,
    block: SharedBlock,
    bytes: usize,
    last_used: u64,
    children: usize,
}

pub struct PrefixCache {
    /// (parent entry id, or the namespace's root id; the block's tokens) -> the block.
    entries: HashMap<(u64, Vec<u32>), Entry>,
    /// Entry id -> its key (for eviction, which updates the parent).
    keys: HashMap<u64, (u64, Vec<u32>)>,
    roots: HashMap<Namespace, u64>,
    /// `prompt_cache_key` -> (the entry its last prompt ended at, when it was named).
    named: HashMap<String, (u64, u64)>,
    budget: usize,
    used: usize,
    next_id: u64,
    clock: u64,
}

impl PrefixCache {
    /// A cache of at most `budget` bytes of blocks (0: caching off).
    pub fn new(budget: usize) -> Self {
        Self {
            entries: HashMap::new(),
            keys: HashMap::new(),
            roots: HashMap::new(),
            named: HashMap::new(),
            budget,
            used: 0,
            next_id: 1,
            clock: 0,
        }
    }

    /// Bytes of blocks held now.
    pub fn used_bytes(&self) -> usize {
        self.used
    }

    fn root(&mut self, ns: Namespace) -> u64 {
        let next = &mut self.next_id;
        *self.roots.entry(ns).or_insert_with(|| {
            *next += 1;
            *next - 1
        })
    }

    /// The cached blocks that `tokens` starts with, at most `max_blocks`, in order.
    pub fn lookup(&mut self, ns: Namespace, tokens: &[u32], max_blocks: usize) -> Vec<SharedBlock> {
        let mut parent = self.root(ns);
        let mut found = vec![];
        for block_tokens in tokens.chunks_exact(KV_BLOCK).take(max_blocks) {
            self.clock += 1;
            let Some(e) = self.entries.get_mut(&(parent, block_tokens.to_vec())) else { break };
            e.last_used = self.clock;
            found.push(e.block.clone());
            parent = e.id;
        }
        found
    }

    /// Keeps the full blocks of `cache`, whose positions hold `tokens` (at least its
    /// `full_blocks() · KV_BLOCK` first ones), then evicts down to the budget; `name` (a
    /// `prompt_cache_key`) keeps them before unnamed ones.
    pub fn insert(&mut self, ns: Namespace, tokens: &[u32], cache: &KvCache, name: Option<&str>) {
        if self.budget == 0 {
            return;
        }
        let mut parent = self.root(ns);
        for (b, block_tokens) in tokens.chunks_exact(KV_BLOCK).take(cache.full_blocks()).enumerate() {
            self.clock += 1;
            let key = (parent, block_tokens.to_vec());
            if let Some(e) = self.entries.get_mut(&key) {
                e.last_used = self.clock;
                parent = e.id;
                continue;
            }
            let block = cache.shared_block(b);
            let (id, bytes) = (self.next_id, block.bytes());
            self.next_id += 1;
            if let Some(p) = self.keys.get(&parent).and_then(|k| self.entries.get_mut(k)) {
                p.children += 1;
            }
            self.keys.insert(id, key.clone());
            self.entries.insert(key, Entry { id, block, bytes, last_used: self.clock, children: 0 });
            self.used += bytes;
            parent = id;
        }
        if let Some(name) = name.filter(|_| self.keys.contains_key(&parent)) {
            self.named.insert(name.to_string(), (parent, self.clock));
            if self.named.len() > NAMED {
                let oldest = self.named.iter().min_by_key(|(_, (_, at))| *at).map(|(n, _)| n.clone()).expect("not empty");
                self.named.remove(&oldest);
            }
        }
        self.evict_to_budget();
    }

    fn evict_to_budget(&mut self) {
        while self.used > self.budget {
            let kept: HashSet<u64> = self.named.values().map(|(id, _)| *id).collect();
            let Some(key) = self
                .entries
                .iter()
                .filter(|(_, e)| e.children == 0)
                .min_by_key(|(_, e)| (kept.contains(&e.id), e.last_used))
                .map(|(k, _)| k.clone())
            else {
                break;
            };
            let e = self.entries.remove(&key).expect("found above");
            self.keys.remove(&e.id);
            self.named.retain(|_, (id, _)| *id != e.id);
            self.used -= e.bytes;
            if let Some(p) = self.keys.get(&key.0).and_then(|k| self.entries.get_mut(k)) {
                p.children -= 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Tensor};

    fn config() -> models::ModelConfig {
        let dir = tempfile::tempdir().unwrap();
        let path = crate::fixtures::write_fixture("llama", dir.path()).unwrap();
        crate::model_files::read_model_config(&path.join("config.json")).unwrap()
    }

    /// A cache of `n` positions whose values say which position and `tag` made them.
    fn cache_of(cfg: &models::ModelConfig, n: usize, tag: f32) -> KvCache {
        let mut cache = KvCache::new(cfg);
        let (kv, d) = (cfg.num_key_value_heads, cfg.head_dim);
        for layer in cache.layers.iter_mut() {
            let x =
                (Tensor::arange(0f32, (kv * n * d) as f32, &Device::Cpu).unwrap() + tag as f64).unwrap().reshape((1, kv, n, d)).unwrap();
            layer.append(&x, &x).unwrap();
        }
        cache
    }

    fn first_key(cfg: &models::ModelConfig, b: &SharedBlock) -> f32 {
        let c = KvCache::from_shared(cfg, std::slice::from_ref(b)).unwrap();
        c.layers[0].all().unwrap().0.flatten_all().unwrap().get(0).unwrap().to_dtype(DType::F32).unwrap().to_scalar::<f32>().unwrap()
    }

    #[test]
    fn hits_need_the_same_tokens_before_and_the_same_namespace() {
        let cfg = config();
        let mut pc = PrefixCache::new(usize::MAX);
        let tokens: Vec<u32> = (0..200).collect();
        pc.insert(None, &tokens, &cache_of(&cfg, 200, 0.0), None);
        assert_eq!(pc.lookup(None, &tokens, 10).len(), 3, "200 positions hold 3 full blocks");
        assert_eq!(pc.lookup(None, &tokens, 2).len(), 2, "at most max_blocks");
        assert_eq!(pc.lookup(Some(7), &tokens, 10).len(), 0, "another model's keys");
        let mut other = tokens.clone();
        other[70] = 9999;
        assert_eq!(pc.lookup(None, &other, 10).len(), 1, "the second block differs");
        other[70] = 70;
        other[3] = 9999;
        assert_eq!(pc.lookup(None, &other, 10).len(), 0, "a later block with the same tokens after a different first");
    }

    #[test]
    fn the_least_recently_used_leaves_go_first() {
        let cfg = config();
        let one = cache_of(&cfg, KV_BLOCK, 0.0).shared_block(0).bytes();
        let mut pc = PrefixCache::new(3 * one);
        let a: Vec<u32> = (0..128).collect();
        let b: Vec<u32> = (0..64).chain(1000..1064).collect();
        pc.insert(None, &a, &cache_of(&cfg, 128, 0.0), None);
        pc.insert(None, &b, &cache_of(&cfg, 128, 0.5), None);
        assert_eq!(pc.used_bytes(), 3 * one, "the shared first block is kept once");
        assert_eq!(first_key(&cfg, &pc.lookup(None, &b, 1)[0]), 0.0, "the first insert's block serves both");
        pc.lookup(None, &a, 2); // a's leaf is now the most recent
        let c: Vec<u32> = (5000..5064).collect();
        pc.insert(None, &c, &cache_of(&cfg, 64, 0.0), None);
        assert_eq!(pc.used_bytes(), 3 * one);
        assert_eq!(pc.lookup(None, &b, 2).len(), 1, "b's leaf was the least recently used");
        assert_eq!(pc.lookup(None, &a, 2).len(), 2);
        assert_eq!(pc.lookup(None, &c, 1).len(), 1);
    }

    #[test]
    fn a_named_conversation_outlives_unnamed_prompts() {
        let cfg = config();
        let one = cache_of(&cfg, KV_BLOCK, 0.0).shared_block(0).bytes();
        let mut pc = PrefixCache::new(3 * one);
        let chat: Vec<u32> = (0..128).collect();
        pc.insert(None, &chat, &cache_of(&cfg, 128, 0.0), Some("conversation-1"));
        // Three one-off prompts after it, each one block: without the name, the chat's blocks
        // (the least recently used) would go first.
        for k in 1..4u32 {
            let other: Vec<u32> = (k * 1000..k * 1000 + 64).collect();
            pc.insert(None, &other, &cache_of(&cfg, 64, 0.0), None);
        }
        assert_eq!(pc.lookup(None, &chat, 2).len(), 2, "the named conversation is kept whole");
        assert_eq!(pc.used_bytes(), 3 * one);
        assert_eq!(pc.lookup(None, &(3000..3064).collect::<Vec<u32>>(), 1).len(), 1, "the newest unnamed prompt too");
        assert_eq!(pc.lookup(None, &(1000..1064).collect::<Vec<u32>>(), 1).len(), 0, "older unnamed ones went");
    }
}
