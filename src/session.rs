//! Sessions: one conversation's state on a shared model, swapped, saved, restored and forked
//! exactly; snapshots that let a new prompt resume from the longest processed prefix of it.
//!
//! A [`Session`] owns one sequence: its token history, how much of it the state has consumed
//! (its position), its sampling settings (seed included) and its state, which lives either in a
//! backend slot (resident) or in host memory (swapped out). [`crate::engine::Engine`] owns the
//! model and does everything that touches the backend: feeding, swapping, forking, saving and
//! loading, and the [`PrefixCache`] of snapshots.
//!
//! Exactness comes from the numerical contract (docs/numerics.md): the state after a token
//! prefix is a pure function of the weights and the prefix, whatever the chunking or batching
//! that produced it, and the sampler is stateless (Philox keyed by seed and position). So a
//! state copied out and back in, written to a file and read in another process, or taken from
//! a snapshot of another session that processed the same prefix, continues with the same bits.
//!
//! # The session file (format version 1)
//!
//! Little-endian throughout, written atomically (a temporary file beside the target, synced,
//! then renamed over it):
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 8 | magic `\x89TFSESS\n` |
//! | 8 | 4 | format version, u32 = 1 |
//! | 12 | 4 | flags, u32: bit 0 set = integer products ([`Products::Int`]), clear = f32 products; the other bits 0 (reserved) |
//! | 16 | 8 | file length in bytes, u64, checksum included |
//! | 24 | 16 | model identity ([`ModelIdentity`], xxh3-128, little-endian u128) |
//! | 40 | 48 | sampling: temperature, top_p, min_p, repetition_penalty, presence_penalty, frequency_penalty (f32 each), top_k (u64), repeat_last_n (i64), seed (u64) |
//! | 88 | 8 | position (tokens the state has consumed), u64 |
//! | 96 | 8 | token count `T` (history, `>=` position), u64 |
//! | 104 | 8 | meta length `M` in bytes, u64 |
//! | 112 | 40 | state layout: conv arrays, recurrent arrays, attention layers (u32 each), u32 0, conv array length, recurrent array length, KV row width `Hkv·Dh` (u64 each) |
//! | 152 | `4T` | token ids, u32 |
//! | | `M` | meta: UTF-8 chosen by the application (the chat stores its messages as JSON) |
//! | | | conv windows, then recurrent states, then keys, then values (f32; keys and values `position · Hkv · Dh` each) |
//! | end − 8 | 8 | checksum: xxh3-64 of every byte before it |
//!
//! The state and every later logit depend on the arithmetic of the products
//! ([`crate::backend::Products`], docs/numerics.md §2 and §2.2), so the file records it in bit 0
//! of the flags and a restore under the other mode is refused ([`SessionError::Products`]). The
//! field was reserved and written as 0 before, so the layout and the version are unchanged: a
//! file of an earlier build reads as f32 products, which is what it was computed with unless
//! `TENSORFOLD_PRODUCTS=int` was set (those builds did not record it). A reader refuses flag bits
//! it does not know ([`SessionError::Flags`]). Builds before this field ignored the flags, so
//! they would resume an integer-products file with f32 products.

use std::borrow::Cow;
use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use xxhash_rust::xxh3::Xxh3;

use crate::backend::{BackendError, Products, SequenceState};
use crate::config::{LayerType, ModelConfig};
use crate::sampling::{Sampler, SamplingParams};

/// Why a session could not be saved, loaded or used.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    /// (The I/O error is part of the message, not a chained source, so it prints once.)
    #[error("{path}: {error}")]
    Io { path: PathBuf, error: std::io::Error },
    #[error("{path}: not a tensorfold session file (its first bytes are not the session magic)")]
    NotASession { path: PathBuf },
    #[error("{path}: session format version {found}; this build reads version {supported}")]
    Version { path: PathBuf, found: u32, supported: u32 },
    #[error("{path}: truncated: expected {expected} bytes, found {found}")]
    Truncated { path: PathBuf, expected: u64, found: u64 },
    #[error("{path}: checksum mismatch (stored {stored:016x}, computed {computed:016x}): the file is corrupt")]
    Checksum { path: PathBuf, stored: u64, computed: u64 },
    #[error("{path}: corrupt: {reason}")]
    Corrupt { path: PathBuf, reason: String },
    #[error("{path}: belongs to a different model (identity {file}, this model {this})")]
    OtherModel { path: PathBuf, file: ModelIdentity, this: ModelIdentity },
    #[error("{path}: the session does not fit this model: {reason}")]
    Shape { path: PathBuf, reason: String },
    /// The state was computed with other products than this run's: continuing it would mix two
    /// arithmetics (other bits than either gives alone).
    #[error("{path}: the session was saved with {saved} products and this run uses {this} products; resume it with the mode it was saved with (--products {saved})")]
    Products { path: PathBuf, saved: Products, this: Products },
    /// The header's flags hold bits this build does not know (a file of a newer format).
    #[error("{path}: session flags {flags:#x} hold bits this build does not know (bit 0, integer products, is the only one)")]
    Flags { path: PathBuf, flags: u32 },
    /// Writing the file failed (the error names it; nothing was left behind).
    #[error(transparent)]
    Write(#[from] crate::fsutil::WriteError),
    /// A token id of the history is not a row of this model's embedding.
    #[error("{path}: token {index} of the history is id {id}, outside this model's vocabulary of {vocab_size}")]
    TokenId { path: PathBuf, index: usize, id: u32, vocab_size: usize },
    /// A state value is NaN or infinite: the file was written from a broken state, and every
    /// logit computed from it would be NaN.
    #[error("{path}: {array} of layer {layer} holds {value} at element {index}")]
    NonFinite { path: PathBuf, array: &'static str, layer: usize, index: usize, value: f32 },
    #[error("model identity: {0}")]
    Identity(String),
    #[error(transparent)]
    Backend(#[from] BackendError),
}

/// Where a session's state lives.
#[derive(Debug)]
pub(crate) enum Residence {
    /// In a backend slot.
    Device(u32),
    /// In host memory (swapped out, or loaded and not yet placed): holds no backend memory.
    Host(Box<SequenceState>),
}

/// One conversation: its token history, its state, its sampling settings.
///
/// Created, fed, swapped, forked, saved and freed through [`crate::engine::Engine`]. A session
/// does not free its slot when dropped (it does not know its engine): hand it to
/// [`crate::engine::Engine::free_session`].
#[derive(Debug)]
pub struct Session {
    /// Every id of the sequence so far: the consumed ones (`..position`), then pending ones
    /// (pushed, e.g. a sampled token, and not yet fed through the model).
    pub(crate) tokens: Vec<u32>,
    /// Tokens the state has consumed.
    pub(crate) position: usize,
    pub(crate) home: Residence,
    /// Sampling settings (seed included); saved with the session.
    pub params: SamplingParams,
    /// Application data saved with the session (UTF-8; the chat keeps its messages here).
    pub meta: String,
}

impl Session {
    pub(crate) fn new(home: Residence, params: SamplingParams) -> Self {
        Self { tokens: Vec::new(), position: 0, home, params, meta: String::new() }
    }

    /// Every id of the sequence: consumed, then pending.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Tokens the state has consumed (the position of the next token fed).
    pub fn position(&self) -> usize {
        self.position
    }

    /// Ids pushed but not yet fed through the model.
    pub fn pending(&self) -> &[u32] {
        &self.tokens[self.position..]
    }

    /// Appends `id` to the history without feeding it (a sampled token; the next
    /// [`crate::engine::Engine::feed`] processes it).
    pub fn push(&mut self, id: u32) {
        self.tokens.push(id);
    }

    /// The backend slot holding the state, or `None` when it lives in host memory.
    pub fn slot(&self) -> Option<u32> {
        match self.home {
            Residence::Device(s) => Some(s),
            Residence::Host(_) => None,
        }
    }

    /// Whether the state is in a backend slot.
    pub fn is_resident(&self) -> bool {
        self.slot().is_some()
    }

    /// Samples the next id from `logits` (the row after the last token) with this session's
    /// settings: the whole history as the penalty window, the history length as the position
    /// that keys the random draw.
    pub fn sample(&self, sampler: &mut Sampler, logits: &[f32]) -> u32 {
        sampler.sample(logits, &self.tokens, self.tokens.len() as u64, &self.params)
    }
}

/// How much of a prompt [`crate::engine::Engine::prompt`] did not have to process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reuse {
    /// Leading tokens of the prompt whose state was reused.
    pub reused: usize,
    /// Whether they came from a snapshot (else from the session's own state).
    pub from_snapshot: bool,
    /// Tokens fed through the model (`prompt length − reused`).
    pub processed: usize,
}

/// When snapshots are taken and how much memory they may hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SnapshotConfig {
    /// Take one whenever a session's position reaches a multiple of `every` (0: only at the
    /// end of prompts).
    pub every: usize,
    /// Bytes the snapshots kept in host memory may hold together ([`snapshot_bytes`] each); the
    /// least recently used go first.
    pub budget_bytes: u64,
    /// Bytes the snapshots kept in backend slots may hold together (on a GPU, device memory:
    /// taking or resuming one is a copy on the device, no host round trip). Past it the least
    /// recently used are dropped; while nothing runs, the oldest move to host memory (within
    /// `budget_bytes`) until the slots hold at most half of this
    /// ([`crate::engine::Engine::spill_idle`]). 0: every snapshot is kept in host memory.
    pub device_budget_bytes: u64,
}

/// Snapshot stride by default: llama.cpp spaces its context checkpoints at least 256 tokens
/// apart, and prompts are fed in chunks of 256 ([`crate::engine::DEFAULT_CHUNK`]), so a snapshot
/// costs no extra step.
pub const DEFAULT_SNAPSHOT_EVERY: usize = 256;
/// Snapshot memory budget (host) by default: 1 GiB.
pub const DEFAULT_SNAPSHOT_BUDGET: u64 = 1 << 30;

impl Default for SnapshotConfig {
    /// Every [`DEFAULT_SNAPSHOT_EVERY`] tokens within [`DEFAULT_SNAPSHOT_BUDGET`] of host memory,
    /// none in backend slots.
    fn default() -> Self {
        Self { every: DEFAULT_SNAPSHOT_EVERY, budget_bytes: DEFAULT_SNAPSHOT_BUDGET, device_budget_bytes: 0 }
    }
}

impl SnapshotConfig {
    /// No snapshots.
    pub fn disabled() -> Self {
        Self { every: 0, budget_bytes: 0, device_budget_bytes: 0 }
    }

    pub fn enabled(&self) -> bool {
        self.budget_bytes > 0 || self.device_budget_bytes > 0
    }
}

/// Bytes of one session state of `position` tokens for `cfg` (f32): conv windows
/// `L_gdn·(Kc−1)·conv_dim·4` + recurrent states `L_gdn·Hv·dv·dk·4` + KV cache
/// `position·L_attn·2·Hkv·Dh·4` (ARCHITECTURE.md, `crate::model::cost::Costs::state_bytes`).
pub fn state_bytes(cfg: &ModelConfig, position: usize) -> u64 {
    let lin = cfg.num_linear_layers() as u64;
    let conv = (cfg.linear_conv_kernel_dim as u64 - 1) * cfg.conv_dim() as u64;
    let rec = (cfg.linear_num_value_heads * cfg.linear_value_head_dim * cfg.linear_key_head_dim) as u64;
    let kv = (cfg.num_full_layers() * 2 * cfg.num_key_value_heads * cfg.head_dim) as u64;
    4 * (lin * (conv + rec) + position as u64 * kv)
}

/// Bytes a snapshot of `position` tokens holds: the state ([`state_bytes`]) plus its token ids
/// (4 bytes each).
pub fn snapshot_bytes(cfg: &ModelConfig, position: usize) -> u64 {
    state_bytes(cfg, position) + 4 * position as u64
}

/// The state after a token prefix, kept so that a later prompt starting with the same tokens
/// resumes from it.
#[derive(Debug)]
pub struct Snapshot {
    tokens: Vec<u32>,
    home: SnapshotHome,
    bytes: u64,
    last_used: u64,
}

/// Where a snapshot's state is kept.
#[derive(Debug)]
pub enum SnapshotHome {
    /// In host memory.
    Host(SequenceState),
    /// In a backend slot of its own (allocated and freed by [`crate::engine::Engine`]).
    Slot(u32),
}

/// The memory a snapshot is kept in, each with its own budget and LRU order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Tier {
    Host = 0,
    Slot = 1,
}

impl SnapshotHome {
    fn tier(&self) -> Tier {
        match self {
            SnapshotHome::Host(_) => Tier::Host,
            SnapshotHome::Slot(_) => Tier::Slot,
        }
    }
}

/// A snapshot that left the slot tier ([`PrefixCache::insert_slot`], [`PrefixCache::set_config`],
/// [`PrefixCache::pop_oldest_slot`]): its slot is the caller's to free, after copying the state
/// to host memory if it is to stay ([`PrefixCache::insert`]).
#[derive(Debug, PartialEq, Eq)]
pub struct Displaced {
    pub tokens: Vec<u32>,
    pub slot: u32,
    pub bytes: u64,
}

impl Snapshot {
    /// The prefix (the state's position is its length).
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }
    /// Where the state is.
    pub fn home(&self) -> &SnapshotHome {
        &self.home
    }
    /// Memory held ([`snapshot_bytes`] of its length).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

/// Snapshots of states by token prefix, within a memory budget, least recently used evicted
/// first. The state after a prefix does not depend on the session that computed it, so one
/// cache serves every session of a model.
///
/// The prefixes are the paths of a token trie: finding the longest snapshot that prefixes a
/// prompt walks the prompt once (`O(len · log fan-out)`), whatever the number of snapshots.
#[derive(Debug)]
pub struct PrefixCache {
    config: SnapshotConfig,
    /// Snapshots by slab index (`None`: a free index).
    entries: Vec<Option<Snapshot>>,
    free: Vec<usize>,
    /// Per tier (host, slot): `last_used → entry`, oldest first.
    lru: [std::collections::BTreeMap<u64, usize>; 2],
    trie: Trie,
    /// Per tier: bytes held.
    bytes: [u64; 2],
    clock: u64,
    /// Lookups that found a snapshot, and the tokens those snapshots held.
    hits: u64,
    reused_tokens: u64,
    lookups: u64,
}

/// A token trie whose nodes may mark a snapshot (node 0 is the empty prefix).
#[derive(Debug)]
struct Trie {
    nodes: Vec<TrieNode>,
    free: Vec<usize>,
}

#[derive(Debug, Default)]
struct TrieNode {
    /// `(token, child node)`, sorted by token.
    children: Vec<(u32, usize)>,
    parent: usize,
    token: u32,
    /// The snapshot of this prefix (an index into `PrefixCache::entries`).
    entry: Option<usize>,
}

impl Trie {
    fn new() -> Self {
        Self { nodes: vec![TrieNode::default()], free: Vec::new() }
    }

    fn child(&self, node: usize, token: u32) -> Option<usize> {
        let c = &self.nodes[node].children;
        c.binary_search_by_key(&token, |&(t, _)| t).ok().map(|i| c[i].1)
    }

    /// The node of `tokens`, if present.
    fn find(&self, tokens: &[u32]) -> Option<usize> {
        tokens.iter().try_fold(0, |n, &t| self.child(n, t))
    }

    /// The node of `tokens`, created as needed.
    fn insert(&mut self, tokens: &[u32]) -> usize {
        let mut n = 0;
        for &t in tokens {
            n = match self.nodes[n].children.binary_search_by_key(&t, |&(c, _)| c) {
                Ok(i) => self.nodes[n].children[i].1,
                Err(i) => {
                    let node = TrieNode { children: Vec::new(), parent: n, token: t, entry: None };
                    let id = match self.free.pop() {
                        Some(id) => {
                            self.nodes[id] = node;
                            id
                        }
                        None => {
                            self.nodes.push(node);
                            self.nodes.len() - 1
                        }
                    };
                    self.nodes[n].children.insert(i, (t, id));
                    id
                }
            };
        }
        n
    }

    /// Clears the mark of `node` and removes the nodes that then lead to no snapshot.
    fn remove(&mut self, mut node: usize) {
        self.nodes[node].entry = None;
        while node != 0 && self.nodes[node].entry.is_none() && self.nodes[node].children.is_empty() {
            let (parent, token) = (self.nodes[node].parent, self.nodes[node].token);
            let c = &mut self.nodes[parent].children;
            if let Ok(i) = c.binary_search_by_key(&token, |&(t, _)| t) {
                c.remove(i);
            }
            self.free.push(node);
            node = parent;
        }
    }

    /// The deepest marked node along `ids[..max_len]`.
    fn longest(&self, ids: &[u32], max_len: usize) -> Option<usize> {
        let mut best = None;
        let mut n = 0;
        for &t in &ids[..max_len.min(ids.len())] {
            match self.child(n, t) {
                Some(c) => n = c,
                None => break,
            }
            if let Some(e) = self.nodes[n].entry {
                best = Some(e);
            }
        }
        best
    }
}

/// Counters of a [`PrefixCache`] since it was made.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixStats {
    /// Prompt lookups, and those that found a snapshot.
    pub lookups: u64,
    pub hits: u64,
    /// Prompt tokens those snapshots covered.
    pub reused_tokens: u64,
}

impl PrefixCache {
    pub fn new(config: SnapshotConfig) -> Self {
        Self { config, entries: Vec::new(), free: Vec::new(), lru: Default::default(), trie: Trie::new(), bytes: [0; 2], clock: 0, hits: 0, reused_tokens: 0, lookups: 0 }
    }

    pub fn config(&self) -> SnapshotConfig {
        self.config
    }

    /// Changes the settings, evicting down to the new budgets. Returns the snapshots that left
    /// the slot tier (their slots are the caller's to free).
    #[must_use = "the displaced snapshots' slots must be freed"]
    pub fn set_config(&mut self, config: SnapshotConfig) -> Vec<Displaced> {
        self.config = config;
        self.evict_to(Tier::Host, config.budget_bytes);
        self.evict_to(Tier::Slot, config.device_budget_bytes)
    }

    /// Number of snapshots held.
    pub fn len(&self) -> usize {
        self.lru[0].len() + self.lru[1].len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes held by all snapshots.
    pub fn bytes(&self) -> u64 {
        self.bytes[0] + self.bytes[1]
    }

    /// Bytes held by the snapshots in backend slots.
    pub fn slot_bytes(&self) -> u64 {
        self.bytes[Tier::Slot as usize]
    }

    /// Lookups, hits and reused tokens so far ([`PrefixCache::lookup`]).
    pub fn stats(&self) -> PrefixStats {
        PrefixStats { lookups: self.lookups, hits: self.hits, reused_tokens: self.reused_tokens }
    }

    /// The snapshots, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = &Snapshot> {
        self.entries.iter().flatten()
    }

    /// Drops every snapshot. Returns the slots they held (the caller's to free).
    #[must_use = "the snapshots' slots must be freed"]
    pub fn clear(&mut self) -> Vec<u32> {
        let slots = self.iter().filter_map(|s| if let SnapshotHome::Slot(slot) = s.home { Some(slot) } else { None }).collect();
        self.entries.clear();
        self.free.clear();
        self.lru = Default::default();
        self.trie = Trie::new();
        self.bytes = [0; 2];
        slots
    }

    fn mark_used(&mut self, e: usize) {
        self.clock += 1;
        let entry = self.entries[e].as_mut().expect("a live entry");
        let lru = &mut self.lru[entry.home.tier() as usize];
        lru.remove(&entry.last_used);
        entry.last_used = self.clock;
        lru.insert(self.clock, e);
    }

    /// Whether a snapshot of exactly `tokens` is held (marks it used).
    pub fn touch(&mut self, tokens: &[u32]) -> bool {
        match self.trie.find(tokens).and_then(|n| self.trie.nodes[n].entry) {
            Some(e) => {
                self.mark_used(e);
                true
            }
            None => false,
        }
    }

    /// Whether a snapshot of `bytes` could be kept at all (in either tier).
    pub fn fits(&self, bytes: u64) -> bool {
        self.fits_host(bytes) || self.fits_slot(bytes)
    }

    /// Whether a snapshot of `bytes` could be kept in host memory.
    pub fn fits_host(&self, bytes: u64) -> bool {
        self.config.budget_bytes > 0 && bytes <= self.config.budget_bytes
    }

    /// Whether a snapshot of `bytes` could be kept in a backend slot.
    pub fn fits_slot(&self, bytes: u64) -> bool {
        self.config.device_budget_bytes > 0 && bytes <= self.config.device_budget_bytes
    }

    /// Keeps `state` in host memory as the snapshot of `tokens` (its position must be
    /// `tokens.len()`), evicting the least recently used host snapshots to stay within the
    /// budget. `bytes` is its size ([`snapshot_bytes`]). Returns whether it was kept (not when
    /// larger than the whole budget, or already held).
    pub fn insert(&mut self, tokens: &[u32], state: SequenceState, bytes: u64) -> bool {
        debug_assert_eq!(state.position, tokens.len());
        if !self.fits_host(bytes) || self.touch(tokens) {
            return false;
        }
        let dropped = self.evict_to(Tier::Host, self.config.budget_bytes - bytes);
        debug_assert!(dropped.is_empty());
        self.add(tokens, SnapshotHome::Host(state), bytes);
        true
    }

    /// Keeps backend slot `slot` (holding the state after `tokens`) as the snapshot of
    /// `tokens`, moving the least recently used slot snapshots out to stay within the device
    /// budget. Returns `None` when it was not kept (larger than the budget, or already held:
    /// the slot stays the caller's), else the snapshots displaced to make room.
    #[must_use = "a slot not kept, and the displaced snapshots' slots, must be freed"]
    pub fn insert_slot(&mut self, tokens: &[u32], slot: u32, bytes: u64) -> Option<Vec<Displaced>> {
        if !self.fits_slot(bytes) || self.touch(tokens) {
            return None;
        }
        let displaced = self.evict_to(Tier::Slot, self.config.device_budget_bytes - bytes);
        self.add(tokens, SnapshotHome::Slot(slot), bytes);
        Some(displaced)
    }

    /// Takes the least recently used slot snapshot out of the cache (to free its slot for a
    /// sequence).
    pub fn pop_oldest_slot(&mut self) -> Option<Displaced> {
        let &e = self.lru[Tier::Slot as usize].values().next()?;
        self.remove(e)
    }

    fn add(&mut self, tokens: &[u32], home: SnapshotHome, bytes: u64) {
        self.clock += 1;
        let tier = home.tier() as usize;
        let snap = Snapshot { tokens: tokens.to_vec(), home, bytes, last_used: self.clock };
        let e = match self.free.pop() {
            Some(e) => {
                self.entries[e] = Some(snap);
                e
            }
            None => {
                self.entries.push(Some(snap));
                self.entries.len() - 1
            }
        };
        let node = self.trie.insert(tokens);
        self.trie.nodes[node].entry = Some(e);
        self.lru[tier].insert(self.clock, e);
        self.bytes[tier] += bytes;
    }

    /// The longest snapshot whose tokens are a prefix of `ids` and at most `max_len` long;
    /// marks it used.
    pub fn longest_prefix(&mut self, ids: &[u32], max_len: usize) -> Option<&Snapshot> {
        let e = self.trie.longest(ids, max_len)?;
        self.mark_used(e);
        self.entries[e].as_ref()
    }

    /// [`PrefixCache::longest_prefix`] for a new prompt, counted in [`PrefixCache::stats`].
    pub fn lookup(&mut self, ids: &[u32], max_len: usize) -> Option<&Snapshot> {
        self.lookups += 1;
        let e = self.trie.longest(ids, max_len)?;
        self.hits += 1;
        self.mark_used(e);
        let snap = self.entries[e].as_ref().expect("a live entry");
        self.reused_tokens += snap.tokens.len() as u64;
        Some(snap)
    }

    /// Removes entry `e`; a slot snapshot comes back as [`Displaced`].
    fn remove(&mut self, e: usize) -> Option<Displaced> {
        let snap = self.entries[e].take().expect("a live entry");
        self.free.push(e);
        let tier = snap.home.tier() as usize;
        self.lru[tier].remove(&snap.last_used);
        let node = self.trie.find(&snap.tokens).expect("every entry has its node");
        self.trie.remove(node);
        self.bytes[tier] -= snap.bytes;
        match snap.home {
            SnapshotHome::Slot(slot) => Some(Displaced { tokens: snap.tokens, slot, bytes: snap.bytes }),
            SnapshotHome::Host(_) => None,
        }
    }

    /// Removes the least recently used snapshots of `tier` until it holds at most `budget`
    /// bytes; returns the slot snapshots removed.
    fn evict_to(&mut self, tier: Tier, budget: u64) -> Vec<Displaced> {
        let mut out = Vec::new();
        while self.bytes[tier as usize] > budget {
            let (_, &e) = self.lru[tier as usize].first_key_value().expect("bytes > 0 means entries");
            out.extend(self.remove(e));
        }
        out
    }
}

/// Which model a session belongs to: xxh3-128 of `config.json` and of every safetensors shard
/// (header and tensor bytes), in file-name order. Computed from the files, so two directories
/// holding the same files have the same identity.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ModelIdentity(pub u128);

impl std::fmt::Display for ModelIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

impl ModelIdentity {
    /// Hashes the model in `dir`: config.json, then each shard the checkpoint maps (lengths
    /// before contents, so boundaries cannot shift).
    ///
    /// # Errors
    /// [`SessionError::Identity`] naming the file that could not be read.
    pub fn of_dir(dir: &Path) -> Result<Self, SessionError> {
        let cfg_path = dir.join("config.json");
        let config = std::fs::read(&cfg_path).map_err(|e| SessionError::Identity(format!("{}: {e}", cfg_path.display())))?;
        let ckpt = crate::checkpoint::Checkpoint::open(dir).map_err(|e| SessionError::Identity(e.to_string()))?;
        let mut h = Xxh3::new();
        h.update(b"tensorfold model identity 1\0");
        h.update(&(config.len() as u64).to_le_bytes());
        h.update(&config);
        for (_, bytes) in ckpt.shards() {
            h.update(&(bytes.len() as u64).to_le_bytes());
            h.update(bytes);
        }
        Ok(Self(h.digest128()))
    }
}

/// The session-file magic: a non-ASCII first byte (like PNG's) so that text-mode transfers and
/// text files are caught.
pub const MAGIC: [u8; 8] = *b"\x89TFSESS\n";
/// The format version this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;
const FIXED_HEADER: u64 = 152;

/// The part of a session a file holds, borrowed for writing.
pub(crate) struct SessionRecord<'a> {
    pub tokens: &'a [u32],
    pub params: SamplingParams,
    pub meta: &'a str,
    pub state: Cow<'a, SequenceState>,
    /// The products the state was computed with.
    pub products: Products,
}

/// A session read back from a file.
pub(crate) struct LoadedSession {
    pub tokens: Vec<u32>,
    pub params: SamplingParams,
    pub meta: String,
    pub state: SequenceState,
}

/// Bit 0 of a session file's flags: the state was computed with integer products.
const FLAG_INT_PRODUCTS: u32 = 1;

/// The flags of a file whose state was computed with `products`.
fn flags_of(products: Products) -> u32 {
    match products {
        Products::F32 => 0,
        Products::Int => FLAG_INT_PRODUCTS,
    }
}

/// The products a file's flags record, or `None` when they hold unknown bits.
fn products_of(flags: u32) -> Option<Products> {
    match flags {
        0 => Some(Products::F32),
        FLAG_INT_PRODUCTS => Some(Products::Int),
        _ => None,
    }
}

/// What the body of a session file held, as far as it was read.
enum Body {
    /// Everything: the identity, the session, the stored and the computed checksum.
    Read(ModelIdentity, LoadedSession, u64, u64),
    /// A header describing state arrays of other shapes than this model's (the arrays were not
    /// read): the identity and what differs.
    OtherShapes(ModelIdentity, String),
}

/// A writer that hashes what passes through it.
struct Hashing<W> {
    inner: W,
    hash: Xxh3,
}

impl<W: Write> Hashing<W> {
    fn put(&mut self, b: &[u8]) -> std::io::Result<()> {
        self.hash.update(b);
        self.inner.write_all(b)
    }
    fn f32s(&mut self, xs: &[f32], buf: &mut Vec<u8>) -> std::io::Result<()> {
        for chunk in xs.chunks(16 * 1024) {
            buf.clear();
            buf.extend(chunk.iter().flat_map(|x| x.to_le_bytes()));
            self.put(buf)?;
        }
        Ok(())
    }
}

/// Layout numbers of a state: (conv arrays, recurrent arrays, attention layers, conv length,
/// recurrent length, KV row width).
fn layout(cfg: &ModelConfig) -> (u32, u32, u32, u64, u64, u64) {
    let z = SequenceState::new(cfg);
    (
        z.conv.len() as u32,
        z.recurrent.len() as u32,
        z.keys.len() as u32,
        z.conv.first().map_or(0, Vec::len) as u64,
        z.recurrent.first().map_or(0, Vec::len) as u64,
        (cfg.num_key_value_heads * cfg.head_dim) as u64,
    )
}

/// Writes `rec` to `path` atomically ([`crate::fsutil::write_atomic`]: a unique temporary file
/// beside it, synced, then renamed; removed on error).
pub(crate) fn write_session(path: &Path, rec: &SessionRecord, identity: ModelIdentity, cfg: &ModelConfig) -> Result<(), SessionError> {
    let st = &*rec.state;
    let (n_conv, n_rec, n_attn, conv_len, rec_len, kv_width) = layout(cfg);
    if st.position > rec.tokens.len() {
        return Err(SessionError::Shape { path: path.to_path_buf(), reason: format!("position {} beyond its {} tokens", st.position, rec.tokens.len()) });
    }
    let kv_len = st.position as u64 * kv_width;
    let floats = n_conv as u64 * conv_len + n_rec as u64 * rec_len + 2 * n_attn as u64 * kv_len;
    let total = FIXED_HEADER + 4 * rec.tokens.len() as u64 + rec.meta.len() as u64 + 4 * floats + 8;

    crate::fsutil::write_atomic(path, |file| {
        let mut w = Hashing { inner: BufWriter::with_capacity(1 << 20, file), hash: Xxh3::new() };
        w.put(&MAGIC)?;
        w.put(&FORMAT_VERSION.to_le_bytes())?;
        w.put(&flags_of(rec.products).to_le_bytes())?;
        w.put(&total.to_le_bytes())?;
        w.put(&identity.0.to_le_bytes())?;
        let p = &rec.params;
        for x in [p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty, p.frequency_penalty] {
            w.put(&x.to_le_bytes())?;
        }
        w.put(&(p.top_k as u64).to_le_bytes())?;
        w.put(&p.repeat_last_n.to_le_bytes())?;
        w.put(&p.seed.to_le_bytes())?;
        w.put(&(st.position as u64).to_le_bytes())?;
        w.put(&(rec.tokens.len() as u64).to_le_bytes())?;
        w.put(&(rec.meta.len() as u64).to_le_bytes())?;
        for x in [n_conv, n_rec, n_attn, 0] {
            w.put(&x.to_le_bytes())?;
        }
        for x in [conv_len, rec_len, kv_width] {
            w.put(&x.to_le_bytes())?;
        }
        let ids: Vec<u8> = rec.tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        w.put(&ids)?;
        w.put(rec.meta.as_bytes())?;
        let mut buf = Vec::new();
        for a in st.conv.iter().chain(&st.recurrent) {
            w.f32s(a, &mut buf)?;
        }
        for a in st.keys.iter().chain(&st.values) {
            w.f32s(&a[..kv_len as usize], &mut buf)?;
        }
        let sum = w.hash.digest();
        w.inner.write_all(&sum.to_le_bytes())?;
        let file = w.inner.into_inner().map_err(|e| e.into_error())?;
        debug_assert_eq!(file.metadata()?.len(), total);
        Ok(())
    })?;
    Ok(())
}

/// A reader that hashes what it reads and counts it.
struct Hashed<R> {
    inner: R,
    hash: Xxh3,
    read: u64,
}

impl<R: Read> Hashed<R> {
    fn bytes(&mut self, n: usize) -> std::io::Result<Vec<u8>> {
        let mut b = vec![0u8; n];
        self.inner.read_exact(&mut b)?;
        self.hash.update(&b);
        self.read += n as u64;
        Ok(b)
    }
    fn u32(&mut self) -> std::io::Result<u32> {
        Ok(u32::from_le_bytes(self.bytes(4)?.try_into().unwrap()))
    }
    fn u64(&mut self) -> std::io::Result<u64> {
        Ok(u64::from_le_bytes(self.bytes(8)?.try_into().unwrap()))
    }
    fn f32(&mut self) -> std::io::Result<f32> {
        Ok(f32::from_le_bytes(self.bytes(4)?.try_into().unwrap()))
    }
    fn f32s(&mut self, n: usize) -> std::io::Result<Vec<f32>> {
        let mut out = Vec::with_capacity(n);
        let mut buf = vec![0u8; 64 * 1024];
        let mut left = n;
        while left > 0 {
            let k = left.min(buf.len() / 4);
            self.inner.read_exact(&mut buf[..4 * k])?;
            self.hash.update(&buf[..4 * k]);
            out.extend(buf[..4 * k].chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())));
            left -= k;
        }
        self.read += 4 * n as u64;
        Ok(out)
    }
}

/// Reads and checks a session file: magic, version, length, checksum, model identity (against
/// `identity()`, called only once the file is known intact), the products it was computed with
/// (against `products`, this run's), then the state's shapes against `cfg`.
pub(crate) fn read_session(
    path: &Path,
    cfg: &ModelConfig,
    products: Products,
    identity: &mut dyn FnMut() -> Result<ModelIdentity, SessionError>,
) -> Result<LoadedSession, SessionError> {
    let p = || path.to_path_buf();
    let io = |error| SessionError::Io { path: p(), error };
    let file = File::open(path).map_err(io)?;
    let found = file.metadata().map_err(io)?.len();
    let mut r = Hashed { inner: BufReader::with_capacity(1 << 20, file), hash: Xxh3::new(), read: 0 };
    // Fixed header: magic, version, length.
    if found < 24 {
        let mut head = vec![0u8; found as usize];
        r.inner.read_exact(&mut head).map_err(io)?;
        if !MAGIC.starts_with(&head[..head.len().min(8)]) {
            return Err(SessionError::NotASession { path: p() });
        }
        return Err(SessionError::Truncated { path: p(), expected: FIXED_HEADER + 8, found });
    }
    if r.bytes(8).map_err(io)? != MAGIC {
        return Err(SessionError::NotASession { path: p() });
    }
    let version = r.u32().map_err(io)?;
    if version != FORMAT_VERSION {
        return Err(SessionError::Version { path: p(), found: version, supported: FORMAT_VERSION });
    }
    let flags = r.u32().map_err(io)?;
    let expected = r.u64().map_err(io)?;
    if found < expected {
        return Err(SessionError::Truncated { path: p(), expected, found });
    }
    if found > expected {
        // A damaged length field (or bytes appended): let the checksum over the whole file say so.
        return Err(checksum_error(path, found).unwrap_or_else(|| SessionError::Corrupt { path: p(), reason: format!("{found} bytes, but its header says {expected}") }));
    }
    // The rest, parsed while hashing; any inconsistency is reported as the checksum's verdict
    // when the checksum disagrees (the usual cause), else as what is wrong.
    let this_layout = layout(cfg);
    let body = (|| -> Result<Body, String> {
        let e = |x: std::io::Error| x.to_string();
        let file_id = ModelIdentity(u128::from_le_bytes(r.bytes(16).map_err(e)?.try_into().unwrap()));
        let mut f = [0f32; 6];
        for x in &mut f {
            *x = r.f32().map_err(e)?;
        }
        let top_k = r.u64().map_err(e)?;
        let repeat_last_n = r.u64().map_err(e)? as i64;
        let seed = r.u64().map_err(e)?;
        let params = SamplingParams {
            temperature: f[0],
            top_p: f[1],
            min_p: f[2],
            repetition_penalty: f[3],
            presence_penalty: f[4],
            frequency_penalty: f[5],
            top_k: usize::try_from(top_k).map_err(|_| format!("top_k {top_k} out of range"))?,
            repeat_last_n,
            seed,
        };
        let position = r.u64().map_err(e)?;
        let n_tokens = r.u64().map_err(e)?;
        let meta_len = r.u64().map_err(e)?;
        let (n_conv, n_rec, n_attn, _) = (r.u32().map_err(e)?, r.u32().map_err(e)?, r.u32().map_err(e)?, r.u32().map_err(e)?);
        let (conv_len, rec_len, kv_width) = (r.u64().map_err(e)?, r.u64().map_err(e)?, r.u64().map_err(e)?);
        if position > n_tokens {
            return Err(format!("position {position} beyond its {n_tokens} tokens"));
        }
        // Every size must add up to the file length before anything is allocated.
        let kv_len = position.checked_mul(kv_width).ok_or("KV size overflows")?;
        let floats = (n_conv as u128) * conv_len as u128 + (n_rec as u128) * rec_len as u128 + 2 * (n_attn as u128) * kv_len as u128;
        let need = FIXED_HEADER as u128 + 4 * n_tokens as u128 + meta_len as u128 + 4 * floats + 8;
        if need != expected as u128 {
            return Err(format!("its sections add up to {need} bytes, its header says {expected}"));
        }
        // The file length bounds the bytes of the arrays, not their number (arrays may be empty):
        // arrays of other shapes than this model's are never read, so a header cannot make the
        // reader allocate billions of them.
        let file_layout = (n_conv, n_rec, n_attn, conv_len, rec_len, kv_width);
        if file_layout != this_layout {
            let (c, r, a, cl, rl, w) = this_layout;
            return Ok(Body::OtherShapes(
                file_id,
                format!(
                    "its state has {n_conv} conv arrays of {conv_len}, {n_rec} recurrent arrays of {rec_len} and {n_attn} attention layers of KV width {kv_width}; this model has {c} of {cl}, {r} of {rl} and {a} of {w}"
                ),
            ));
        }
        let tokens: Vec<u32> = r.bytes(4 * n_tokens as usize).map_err(e)?.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect();
        let meta = String::from_utf8(r.bytes(meta_len as usize).map_err(e)?).map_err(|_| "meta is not UTF-8".to_string())?;
        let mut read_arrays = |n: u32, len: u64| -> Result<Vec<Vec<f32>>, String> { (0..n).map(|_| r.f32s(len as usize).map_err(e)).collect() };
        let conv = read_arrays(n_conv, conv_len)?;
        let recurrent = read_arrays(n_rec, rec_len)?;
        let keys = read_arrays(n_attn, kv_len)?;
        let values = read_arrays(n_attn, kv_len)?;
        let computed = r.hash.digest();
        let mut sum = [0u8; 8];
        r.inner.read_exact(&mut sum).map_err(e)?;
        let state = SequenceState { position: position as usize, conv, recurrent, keys, values };
        Ok(Body::Read(file_id, LoadedSession { tokens, params, meta, state }, u64::from_le_bytes(sum), computed))
    })();
    let (file_id, loaded) = match body {
        Ok(Body::Read(id, l, stored, computed)) if stored == computed => (id, l),
        Ok(Body::Read(_, _, stored, computed)) => return Err(SessionError::Checksum { path: p(), stored, computed }),
        Ok(Body::OtherShapes(file_id, reason)) => {
            // The same verdicts, in the same order, as for a file read to the end: damage, then
            // another model, then shapes.
            if let Some(e) = checksum_error(path, found) {
                return Err(e);
            }
            let this = identity()?;
            if file_id != this {
                return Err(SessionError::OtherModel { path: p(), file: file_id, this });
            }
            return Err(SessionError::Shape { path: p(), reason });
        }
        Err(reason) => return Err(checksum_error(path, found).unwrap_or_else(|| SessionError::Corrupt { path: p(), reason })),
    };
    // Known intact from here: what its header says was written so.
    let saved = products_of(flags).ok_or(SessionError::Flags { path: p(), flags })?;
    loaded.params.validate().map_err(|e| SessionError::Corrupt { path: p(), reason: e.to_string() })?;
    let this = identity()?;
    if file_id != this {
        return Err(SessionError::OtherModel { path: p(), file: file_id, this });
    }
    if saved != products {
        return Err(SessionError::Products { path: p(), saved, this: products });
    }
    loaded.state.check(cfg).map_err(|e| SessionError::Shape { path: p(), reason: e.to_string() })?;
    let (n_conv, n_rec, n_attn, conv_len, rec_len, _) = layout(cfg);
    let st = &loaded.state;
    if st.conv.len() != n_conv as usize
        || st.recurrent.len() != n_rec as usize
        || st.keys.len() != n_attn as usize
        || st.conv.iter().any(|c| c.len() as u64 != conv_len)
        || st.recurrent.iter().any(|c| c.len() as u64 != rec_len)
    {
        return Err(SessionError::Shape { path: p(), reason: "state arrays of other shapes".into() });
    }
    check_contents(path, cfg, &loaded)?;
    Ok(loaded)
}

/// Checks what an intact file of the right shapes holds: every token id is a row of the
/// embedding, every state value is finite. The checksum only proves the bytes are the ones
/// written; a file written from a state that had gone NaN, or by another program, would
/// otherwise be fed (an id past the embedding) or turn every later logit into NaN.
fn check_contents(path: &Path, cfg: &ModelConfig, l: &LoadedSession) -> Result<(), SessionError> {
    if let Some((index, &id)) = l.tokens.iter().enumerate().find(|(_, &id)| id as usize >= cfg.vocab_size) {
        return Err(SessionError::TokenId { path: path.to_path_buf(), index, id, vocab_size: cfg.vocab_size });
    }
    // The i-th conv/recurrent array belongs to the i-th GDN layer, the i-th KV array to the
    // i-th attention layer; errors name the layer's index in the model.
    let layers_of = |kind: LayerType| -> Vec<usize> { cfg.layer_types.iter().enumerate().filter(|(_, t)| **t == kind).map(|(i, _)| i).collect() };
    let (linear, full) = (layers_of(LayerType::LinearAttention), layers_of(LayerType::FullAttention));
    let st = &l.state;
    let arrays = [("conv window", &st.conv, &linear), ("recurrent state", &st.recurrent, &linear), ("key cache", &st.keys, &full), ("value cache", &st.values, &full)];
    for (array, values, layers) in arrays {
        for (a, &layer) in values.iter().zip(layers) {
            if let Some((index, &value)) = a.iter().enumerate().find(|(_, v)| !v.is_finite()) {
                return Err(SessionError::NonFinite { path: path.to_path_buf(), array, layer, index, value });
            }
        }
    }
    Ok(())
}

/// Recomputes the checksum of the whole file: `Some(error)` when it does not match the stored
/// one (or cannot be read), `None` when the file is intact.
fn checksum_error(path: &Path, len: u64) -> Option<SessionError> {
    let p = path.to_path_buf();
    let run = || -> std::io::Result<(u64, u64)> {
        let mut f = BufReader::with_capacity(1 << 20, File::open(path)?);
        let mut h = Xxh3::new();
        let mut left = len.saturating_sub(8);
        let mut buf = vec![0u8; 1 << 20];
        while left > 0 {
            let k = (left as usize).min(buf.len());
            f.read_exact(&mut buf[..k])?;
            h.update(&buf[..k]);
            left -= k as u64;
        }
        let mut sum = [0u8; 8];
        f.read_exact(&mut sum)?;
        Ok((u64::from_le_bytes(sum), h.digest()))
    };
    match run() {
        Ok((stored, computed)) if stored == computed => None,
        Ok((stored, computed)) => Some(SessionError::Checksum { path: p, stored, computed }),
        Err(error) => Some(SessionError::Io { path: p, error }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(position: usize, fill: f32) -> SequenceState {
        SequenceState { position, conv: vec![vec![fill; 4]], recurrent: vec![vec![fill; 8]], keys: vec![vec![fill; position * 2]], values: vec![vec![fill; position * 2]] }
    }

    /// A session file with no tokens, no meta and empty state arrays whose header claims the
    /// given array counts, with a correct checksum.
    fn empty_arrays_file(path: &Path, identity: ModelIdentity, counts: (u32, u32, u32)) {
        let mut b = Vec::new();
        b.extend_from_slice(&MAGIC);
        b.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        b.extend_from_slice(&(FIXED_HEADER + 8).to_le_bytes());
        b.extend_from_slice(&identity.0.to_le_bytes());
        for x in [0.8f32, 0.95, 0.05, 1.0, 0.0, 0.0] {
            b.extend_from_slice(&x.to_le_bytes());
        }
        for x in [40u64, 64, 1, 0, 0, 0] {
            // top_k, repeat_last_n, seed, position, tokens, meta length
            b.extend_from_slice(&x.to_le_bytes());
        }
        for x in [counts.0, counts.1, counts.2, 0] {
            b.extend_from_slice(&x.to_le_bytes());
        }
        for x in [0u64, 0, 0] {
            // conv, recurrent lengths and KV width: every array is empty
            b.extend_from_slice(&x.to_le_bytes());
        }
        assert_eq!(b.len() as u64, FIXED_HEADER);
        let sum = xxhash_rust::xxh3::xxh3_64(&b);
        b.extend_from_slice(&sum.to_le_bytes());
        std::fs::write(path, b).unwrap();
    }

    #[test]
    fn a_header_claiming_billions_of_empty_arrays_is_refused_before_reading_them() {
        // The sizes add up to the file length whatever the number of empty arrays, so the reader
        // used to allocate u32::MAX of them (about 100 GB of Vec headers, hours of work) before
        // looking at the shapes.
        let cfg = ModelConfig::from_dir(&crate::testutil::shared("fixtures/tiny/mlx-q4")).unwrap();
        let tmp = crate::testutil::TempDir::new("session-layout");
        let path = tmp.path().join("many.session");
        let id = ModelIdentity(7);
        for counts in [(u32::MAX, 0, 0), (0, 0, u32::MAX), (2, 3, 1)] {
            empty_arrays_file(&path, id, counts);
            let err = read_session(&path, &cfg, Products::F32, &mut || Ok(id)).err().expect("refused");
            assert!(matches!(err, SessionError::Shape { .. }), "{counts:?}: {err}");
            assert!(err.to_string().contains(&format!("its state has {} conv arrays of 0", counts.0)), "{err}");
            // Another model's file is still reported as such.
            let err = read_session(&path, &cfg, Products::F32, &mut || Ok(ModelIdentity(8))).err().expect("refused");
            assert!(matches!(err, SessionError::OtherModel { .. }), "{counts:?}: {err}");
        }
        // A damaged one is reported as damaged.
        let mut b = std::fs::read(&path).unwrap();
        b[30] ^= 1;
        std::fs::write(&path, b).unwrap();
        let err = read_session(&path, &cfg, Products::F32, &mut || Ok(id)).err().expect("refused");
        assert!(matches!(err, SessionError::Checksum { .. }), "{err}");
    }

    #[test]
    fn the_products_are_bit_0_of_the_flags_and_zero_flags_read_as_f32() {
        let cfg = ModelConfig::from_dir(&crate::testutil::shared("fixtures/tiny/mlx-q4")).unwrap();
        let tmp = crate::testutil::TempDir::new("session-flags");
        let id = ModelIdentity(9);
        let state = SequenceState::new(&cfg);
        let write = |name: &str, products: Products| -> (PathBuf, Vec<u8>) {
            let path = tmp.path().join(name);
            let rec = SessionRecord { tokens: &[], params: SamplingParams::default(), meta: "", state: Cow::Borrowed(&state), products };
            write_session(&path, &rec, id, &cfg).unwrap();
            let b = std::fs::read(&path).unwrap();
            (path, b)
        };
        let read = |path: &Path, products: Products| read_session(path, &cfg, products, &mut || Ok(id));
        // f32 writes the flags earlier builds wrote (0), so their files read as f32.
        let (f32_path, f32_bytes) = write("f32.session", Products::F32);
        assert_eq!(f32_bytes[8..16], [1, 0, 0, 0, 0, 0, 0, 0], "version 1, flags 0");
        assert!(read(&f32_path, Products::F32).is_ok());
        assert!(matches!(read(&f32_path, Products::Int), Err(SessionError::Products { saved: Products::F32, this: Products::Int, .. })));
        let (int_path, int_bytes) = write("int.session", Products::Int);
        assert_eq!(int_bytes[12..16], [1, 0, 0, 0], "bit 0 of the flags");
        assert_eq!(int_bytes[..12], f32_bytes[..12]);
        assert_eq!(int_bytes[16..int_bytes.len() - 8], f32_bytes[16..f32_bytes.len() - 8], "the flags are the only difference");
        assert_eq!(read(&int_path, Products::Int).unwrap().state, state);
        assert!(matches!(read(&int_path, Products::F32), Err(SessionError::Products { saved: Products::Int, this: Products::F32, .. })));
        // Bits this build does not know (with a valid checksum) are refused, under either mode.
        let mut b = int_bytes.clone();
        b[12] = 3;
        let n = b.len() - 8;
        let sum = xxhash_rust::xxh3::xxh3_64(&b[..n]);
        b[n..].copy_from_slice(&sum.to_le_bytes());
        std::fs::write(&int_path, &b).unwrap();
        for products in [Products::F32, Products::Int] {
            let err = read(&int_path, products).err().expect("refused");
            assert!(matches!(err, SessionError::Flags { flags: 3, .. }), "{err}");
        }
        // A flipped flag bit without a new checksum is damage.
        let mut b = f32_bytes.clone();
        b[12] ^= 1;
        std::fs::write(&f32_path, &b).unwrap();
        assert!(matches!(read(&f32_path, Products::Int), Err(SessionError::Checksum { .. })));
    }

    #[test]
    fn prefix_cache_finds_the_longest_prefix_within_the_limit() {
        let mut c = PrefixCache::new(SnapshotConfig { every: 4, budget_bytes: 1000, device_budget_bytes: 0 });
        let ids: Vec<u32> = (0..20).collect();
        assert!(c.insert(&ids[..4], state(4, 1.0), 10));
        assert!(c.insert(&ids[..8], state(8, 2.0), 10));
        assert!(c.insert(&[0, 1, 2, 9, 9, 9, 9, 9, 9, 9, 9, 9], state(12, 3.0), 10));
        assert!(!c.insert(&ids[..8], state(8, 2.0), 10), "a prefix already held is not stored twice");
        assert_eq!(c.len(), 3);
        assert_eq!(c.longest_prefix(&ids, 19).unwrap().tokens().len(), 8);
        assert_eq!(c.longest_prefix(&ids, 7).unwrap().tokens().len(), 4);
        assert!(matches!(c.longest_prefix(&ids[..8], 8).unwrap().home(), SnapshotHome::Host(st) if st.recurrent[0][0] == 2.0));
        assert!(c.longest_prefix(&ids, 3).is_none());
        assert!(c.longest_prefix(&[5, 6, 7, 8, 9], 5).is_none());
    }

    #[test]
    fn prefix_cache_evicts_the_least_recently_used_within_its_budget() {
        let mut c = PrefixCache::new(SnapshotConfig { every: 4, budget_bytes: 30, device_budget_bytes: 0 });
        let ids: Vec<u32> = (0..20).collect();
        c.insert(&ids[..1], state(1, 0.0), 10);
        c.insert(&ids[..2], state(2, 0.0), 10);
        c.insert(&ids[..3], state(3, 0.0), 10);
        // Using the oldest makes the second the least recently used.
        assert_eq!(c.longest_prefix(&ids, 1).unwrap().tokens().len(), 1);
        assert!(c.insert(&ids[..4], state(4, 0.0), 15));
        assert!(c.bytes() <= 30);
        let mut held: Vec<usize> = c.iter().map(|s| s.tokens().len()).collect();
        held.sort();
        // 10+10+10+15 > 30: the two least recently used (lengths 2, then 3) went.
        assert_eq!(held, vec![1, 4]);
        assert_eq!(c.bytes(), 25);
        assert!(!c.insert(&ids[..5], state(5, 0.0), 31), "larger than the whole budget");
        assert!(c.set_config(SnapshotConfig { every: 4, budget_bytes: 20, device_budget_bytes: 0 }).is_empty());
        assert_eq!(c.iter().map(|s| s.tokens().len()).collect::<Vec<_>>(), vec![4]);
        assert!(c.set_config(SnapshotConfig::disabled()).is_empty());
        assert!(c.is_empty() && c.bytes() == 0);
        assert!(!c.insert(&ids[..1], state(1, 0.0), 1));
    }

    #[test]
    fn prefix_cache_slot_snapshots_have_their_own_budget_and_come_back_displaced() {
        let mut c = PrefixCache::new(SnapshotConfig { every: 4, budget_bytes: 25, device_budget_bytes: 20 });
        let ids: Vec<u32> = (0..20).collect();
        assert_eq!(c.insert_slot(&ids[..1], 7, 10), Some(vec![]));
        assert_eq!(c.insert_slot(&ids[..2], 8, 10), Some(vec![]));
        assert!(c.insert(&ids[..3], state(3, 0.0), 10));
        assert_eq!(c.insert_slot(&ids[..2], 9, 10), None, "a prefix already held is not stored twice");
        assert_eq!(c.insert_slot(&ids[..5], 9, 21), None, "larger than the slot budget");
        assert_eq!((c.len(), c.bytes(), c.slot_bytes()), (3, 30, 20));
        // Using the oldest slot snapshot makes the second the least recently used of its tier;
        // the host snapshot, older still, is not in the slot tier's way.
        assert_eq!(c.longest_prefix(&ids, 1).unwrap().tokens().len(), 1);
        assert_eq!(c.insert_slot(&ids[..4], 10, 10), Some(vec![Displaced { tokens: ids[..2].to_vec(), slot: 8, bytes: 10 }]));
        assert_eq!(c.longest_prefix(&ids, 19).map(|s| (s.tokens().len(), matches!(s.home(), SnapshotHome::Slot(10)))), Some((4, true)));
        assert_eq!(c.longest_prefix(&ids, 3).map(|s| matches!(s.home(), SnapshotHome::Host(_))), Some(true));
        assert_eq!(c.pop_oldest_slot(), Some(Displaced { tokens: ids[..1].to_vec(), slot: 7, bytes: 10 }));
        assert_eq!(c.longest_prefix(&ids, 2).map(|s| s.tokens().len()), None);
        assert_eq!(c.set_config(SnapshotConfig { every: 4, budget_bytes: 25, device_budget_bytes: 5 }), vec![Displaced { tokens: ids[..4].to_vec(), slot: 10, bytes: 10 }]);
        assert!(c.insert_slot(&ids[..6], 11, 5).is_some());
        assert_eq!((c.len(), c.slot_bytes()), (2, 5));
        assert_eq!(c.clear(), vec![11]);
        assert!(c.is_empty() && c.bytes() == 0);
    }
}

/// A session file's contents, for clients of the batched runtime (which keeps no `Session`s of
/// theirs): the history, settings, application data and state, and the products the state was
/// computed with.
#[derive(Clone, Debug, PartialEq)]
pub struct SessionData {
    pub tokens: Vec<u32>,
    pub params: SamplingParams,
    pub meta: String,
    pub state: SequenceState,
    /// The arithmetic of the products that computed `state` (the backend's
    /// [`crate::backend::Backend::products`]; recorded in the file).
    pub products: Products,
}

impl SessionData {
    /// Writes the session file (the format in the module documentation), atomically.
    ///
    /// # Errors
    /// As [`crate::engine::Engine::save_session`].
    pub fn save(&self, path: &Path, identity: ModelIdentity, cfg: &ModelConfig) -> Result<(), SessionError> {
        let rec = SessionRecord { tokens: &self.tokens, params: self.params, meta: &self.meta, state: std::borrow::Cow::Borrowed(&self.state), products: self.products };
        write_session(path, &rec, identity, cfg)
    }

    /// Reads a session file written for the model of `identity` and `cfg`, to continue with
    /// `products` (this run's: a file saved under the other mode is refused).
    ///
    /// # Errors
    /// As [`crate::engine::Engine::load_session`].
    pub fn load(path: &Path, cfg: &ModelConfig, identity: ModelIdentity, products: Products) -> Result<Self, SessionError> {
        let l = read_session(path, cfg, products, &mut || Ok(identity))?;
        Ok(Self { tokens: l.tokens, params: l.params, meta: l.meta, state: l.state, products })
    }
}
